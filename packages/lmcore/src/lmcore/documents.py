"""Packed-document boundaries: where each document of a (B, T) batch of token windows starts and ends.

Pretraining windows are cut from a stream in which every document ends with a separator token (tokbin writes
the tokenizer's EOS after each one). `document_starts` gives each token the first token of its document, the
batch layout `alibi_kernels.alibi_attention(document_starts=...)` takes with no host read (the torch path, and a
compiled graph); `document_boundaries` turns a batch into the `cu_seqlens` layout of
`alibi_kernels.alibi_attention_varlen` (the Triton path). Either way attention stays inside each document.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class Documents(NamedTuple):
    cu_seqlens: Tensor  # (n_docs + 1,) int32 offsets into the flattened (B * T) tokens, on the input's device
    max_seqlen: int  # the longest document, in tokens


def document_boundaries(input_ids: Tensor, separator: int) -> Documents:
    """The documents of each row of `input_ids` (B, T), flattened row after row, as varlen offsets.

    A document ends with the separator token (the separator belongs to the document it closes) or with its
    row; the token after a separator starts a new document. A row's first document may be the tail of one that
    began in an earlier window: it is a document like any other. Built with vectorised torch ops on the input's
    device; `max_seqlen` costs one device-to-host copy.

    Example:
        >>> document_boundaries(torch.tensor([[5, 2, 7, 8], [2, 3, 2, 4]]), separator=2)
        Documents(cu_seqlens=tensor([0, 2, 4, 5, 7, 8], dtype=torch.int32), max_seqlen=2)
    """
    if input_ids.dim() != 2 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must be (B, T) with T >= 1, got shape {tuple(input_ids.shape)}")
    ends = input_ids == separator  # (B, T): True where a document closes after this token
    ends[:, -1] = True  # every row's last token closes its last document, so the next row starts a new one
    # nonzero() gives the flat index of each closing token; +1 turns it into an exclusive end offset.
    stops = ends.flatten().nonzero().squeeze(1) + 1  # (n_docs,)
    # int32 is flash-attn's type; beyond 2^31 tokens per batch only int64 can hold the offsets.
    dtype = torch.int32 if input_ids.numel() < 2**31 else torch.int64
    cu_seqlens = torch.cat([stops.new_zeros(1), stops]).to(dtype)  # (n_docs + 1,)
    max_seqlen = int(torch.diff(cu_seqlens).max())
    return Documents(cu_seqlens, max_seqlen)


def document_starts(input_ids: Tensor, separator: int) -> Tensor:
    """(B, T) int64: the index in its row of the first token of each token's document, with the documents cut as
    `document_boundaries` cuts them (a separator closes its document; each row starts one). Vectorised on the
    input's device, no host read.

    Example:
        >>> document_starts(torch.tensor([[5, 2, 7, 8], [2, 3, 2, 4]]), separator=2)
        tensor([[0, 0, 2, 2],
                [0, 1, 1, 3]])
    """
    if input_ids.dim() != 2 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must be (B, T) with T >= 1, got shape {tuple(input_ids.shape)}")
    B, T = input_ids.shape
    index = torch.arange(T, device=input_ids.device).expand(B, T)  # (B, T)
    begins = torch.zeros_like(input_ids, dtype=torch.bool)
    begins[:, 1:] = input_ids[:, :-1] == separator  # a document starts after each separator
    return torch.where(begins, index, torch.zeros_like(index)).cummax(dim=1).values  # (B, T)
