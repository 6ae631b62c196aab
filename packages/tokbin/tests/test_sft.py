import pytest
import sentencepiece as spm
import torch

from tokbin import IGNORE_INDEX, sft_example

TEMPLATE = "<|user|>\n{prompt}\n<|assistant|>\n{response}<|end|>"


@pytest.fixture(scope="module")
def sp(lossless_model):
    return spm.SentencePieceProcessor(model_file=str(lossless_model))


def test_prompt_positions_are_masked_and_specials_are_single_tokens(lossless_model, sp):
    ids, labels = sft_example(lossless_model, "Who art thou?", "A king.", TEMPLATE)
    assert ids.dtype == labels.dtype == torch.long and ids.shape == labels.shape
    user, assistant, end = (sp.piece_to_id(p) for p in ("<|user|>", "<|assistant|>", "<|end|>"))
    ids_l = ids.tolist()
    assert ids_l[0] == user and ids_l.count(assistant) == 1 and ids_l[-2:] == [end, sp.eos_id()]
    boundary = ids_l.index(assistant) + 2  # <|assistant|> and the newline after it are prompt side
    assert (labels[:boundary] == IGNORE_INDEX).all()
    assert torch.equal(labels[boundary:], ids[boundary:])
    assert sp.decode(ids[boundary:-1].tolist()) == "A king.<|end|>"
    assert sp.decode(ids[:boundary].tolist()) == "<|user|>\nWho art thou?\n<|assistant|>\n"


def test_without_eos(lossless_model, sp):
    ids, labels = sft_example(lossless_model, "q", "a", TEMPLATE, eos=False)
    assert ids[-1].item() == sp.piece_to_id("<|end|>") and labels[-1].item() == ids[-1].item()


@pytest.mark.parametrize(
    "bad", ["{prompt} only", "{response} then {prompt}", "{prompt}{prompt}{response}"], ids=["no-resp", "order", "dup"]
)
def test_bad_templates(lossless_model, bad):
    with pytest.raises(ValueError, match="template"):
        sft_example(lossless_model, "q", "a", bad)
