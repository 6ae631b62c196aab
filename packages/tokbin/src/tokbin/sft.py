"""Supervised fine-tuning samples: a chat template around (prompt, response), with the prompt masked out of the loss."""

from __future__ import annotations

import os

import sentencepiece as spm
import torch

from tokbin.tokenizer import load_processor

IGNORE_INDEX = -100


def _split_template(template: str) -> tuple[str, str]:
    if template.count("{prompt}") != 1 or template.count("{response}") != 1:
        raise ValueError(f"template must contain '{{prompt}}' and '{{response}}' exactly once each, got {template!r}")
    head, tail = template.split("{response}")
    if "{prompt}" not in head:
        raise ValueError(f"template must place '{{prompt}}' before '{{response}}', got {template!r}")
    return head, tail


def sft_example(
    tokenizer: str | os.PathLike | spm.SentencePieceProcessor,
    prompt: str,
    response: str,
    template: str,
    *,
    eos: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of a templated chat sample and labels that are -100 on every prompt-side position.

    ``template`` holds ``{prompt}`` then ``{response}``; everything up to ``{response}`` (the prompt and the
    template's markers around it) is masked, the response and whatever follows it in the template (e.g. an end
    marker), plus EOS when ``eos`` is set, are learned. Special markers are matched as single tokens when the
    tokenizer was trained with them as ``user_defined_symbols``. The two sides are encoded separately, so no
    token straddles the boundary. Labels are aligned with ``input_ids`` (not shifted): the loss for position t
    predicts ``labels[t + 1]`` from ``input_ids[:t + 1]``, i.e. use ``input_ids[:-1]`` and ``labels[1:]``.

    Example::

        ids, labels = sft_example("spm.model", "Hi?", "Hello.", "<|user|>{prompt}<|assistant|>{response}<|end|>")
        # labels == -100 up to and including <|assistant|>, then the ids of "Hello.<|end|>" and EOS
    """
    sp = load_processor(tokenizer)
    head, tail = _split_template(template)
    prompt_ids = sp.encode(head.replace("{prompt}", prompt))
    response_ids = sp.encode(response + tail)
    if eos:
        if sp.eos_id() < 0:
            raise ValueError("eos=True but the tokenizer has no EOS piece; pass eos=False")
        response_ids.append(sp.eos_id())
    if not response_ids:
        raise ValueError("response: expected text to learn, found an empty response and template tail")
    input_ids = torch.tensor(prompt_ids + response_ids, dtype=torch.long)
    labels = torch.tensor([IGNORE_INDEX] * len(prompt_ids) + response_ids, dtype=torch.long)
    return input_ids, labels
