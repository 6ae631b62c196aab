"""The one exception type tokbin raises for bad files and bad input."""

from __future__ import annotations


class TokenFileError(ValueError):
    """A token file, tokenizer or input text is not what was expected.

    The message always names the file and says what was expected and what was found, e.g.
    ``data.bin: truncated: header says 1000 tokens (2128 bytes), file has 2126 bytes``.
    """

    def __init__(self, path: object, message: str) -> None:
        self.path = str(path)
        self.reason = message
        super().__init__(f"{self.path}: {message}")

    def __reduce__(self):
        # raised in an encode worker process and re-raised in the parent: rebuild from (path, message)
        return (type(self), (self.path, self.reason))
