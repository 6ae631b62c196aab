"""A tiny Hugging Face base model written by transformers inside the tests (no download): a random Qwen2 (q/k/v
biases, grouped KV heads, tied embeddings) or Llama with a byte-level BPE trained here on standard-library source,
ChatML's special tokens and a ChatML chat template, saved as transformers saves a published chat model."""

from __future__ import annotations

from pathlib import Path

CHATML = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>'"
    " + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def write_qwen2_base(directory: Path, *, seed: int = 0, layers: int = 2, architecture: str = "qwen2") -> Path:
    """``directory`` holding config.json, model.safetensors, tokenizer.json, tokenizer_config.json and the template;
    ``architecture`` "qwen2" (Qwen2ForCausalLM) or "llama" (LlamaForCausalLM, the same sizes, no biases)."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    from lmtrain.corpus import build_corpus

    directory.mkdir(parents=True, exist_ok=True)
    corpus = directory.parent / f".{directory.name}-corpus.txt"
    build_corpus(corpus, 200_000)
    text = corpus.read_text(encoding="utf-8")
    corpus.unlink()
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator([text[i : i + 2000] for i in range(0, len(text), 2000)], trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                     chat_template=CHATML)  # fmt: skip
    hf_tok.save_pretrained(directory)
    torch.manual_seed(seed)
    config_class, model_class = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[
        architecture
    ]
    config = config_class(vocab_size=tok.get_vocab_size(), hidden_size=64, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                          max_position_embeddings=512, tie_word_embeddings=True,
                          eos_token_id=tok.token_to_id("<|im_end|>"))  # fmt: skip
    model_class(config).save_pretrained(directory)
    return directory
