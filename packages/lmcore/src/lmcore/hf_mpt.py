"""An lmcore GPT as transformers' `MptForCausalLM` (no custom code), and its LoRA adapters in PEFT's layout.

Checked against transformers' `modeling_mpt.py` (5.x): MPT's ALiBi slopes (`build_mpt_alibi_tensor`,
alibi_bias_max 8) are the paper's, ours, for any head count; MPT adds `slope * (j - (T - 1))` to the scores, a
per-row constant away from our `-slope * (i - j)`, so the softmax is the same; scores are scaled by
1/sqrt(head_dim) as ours; the MLP is `Linear(d, 4d) -> exact GELU -> Linear(4d, d)`; every Linear and LayerNorm
has no bias; the embedding is tied to the output head; LayerNorm's eps is `layer_norm_epsilon`. So the model maps
exactly when it has no biases, LayerNorm, GELU with d_ff = 4 * d_model, one KV head per query head (MPT's fused
`Wqkv` is q, k, v concatenated), tied embeddings, fixed slopes and no document separator (MPT attends across
separators). `mpt_mismatches` names what does not.

MPT builds its bias for `max_seq_len` positions and cannot run longer inputs, so the export sets it above the
training context (ALiBi extrapolates; the bias costs `n_head * max_seq_len` floats per forward).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from lmcore.config import ModelConfig
from lmcore.extras import import_hf
from lmcore.lora import LoRALinear, lora_modules

if TYPE_CHECKING:
    from lmcore.model import GPT, Block

# How many training contexts an exported MPT covers by default (its `max_seq_len`).
DEFAULT_CONTEXT_MULTIPLE = 4
# lmcore linear layer -> MPT module (q, k and v all go to the fused Wqkv).
MPT_MODULES = {
    "q_proj": "attn.Wqkv",
    "k_proj": "attn.Wqkv",
    "v_proj": "attn.Wqkv",
    "o_proj": "attn.out_proj",
    "up_proj": "ffn.up_proj",
    "down_proj": "ffn.down_proj",
}


def mpt_mismatches(config: ModelConfig) -> list[str]:
    """The fields of `config` that transformers' MPT cannot express, as "field=value (MPT: what it has)"; empty
    when the model maps exactly.

    Example:
        >>> mpt_mismatches(ModelConfig.from_preset("tiny", bias=False))
        []
        >>> mpt_mismatches(ModelConfig.from_preset("tiny"))
        ['bias=True (MPT: no biases)']
    """
    wanted = [
        ("position", "alibi", "ALiBi"),
        ("bias", False, "no biases"),
        ("qkv_bias", False, "no biases"),
        ("norm", "layernorm", "layernorm"),
        ("activation", "gelu", "exact gelu"),
        ("d_ff", 4 * config.d_model, f"4 * d_model = {4 * config.d_model}"),
        ("n_kv_head", config.n_head, f"n_kv_head = n_head = {config.n_head}"),
        ("tie_embeddings", True, "tied embeddings"),
        ("learnable_slopes", False, "fixed slopes"),
        ("document_separator", None, "attention across documents"),
    ]
    return [
        f"{name}={getattr(config, name)!r} (MPT: {has})" for name, want, has in wanted if getattr(config, name) != want
    ]


def mpt_config(config: ModelConfig, max_seq_len: int | None = None, **token_ids: int | None) -> Any:
    """The `transformers.MptConfig` of `config`; `max_seq_len` defaults to 4 training contexts; `token_ids`
    (`bos_token_id`, `eos_token_id`, `pad_token_id`) go into it as given. Raises ValueError when the model does
    not map (see `mpt_mismatches`).

    Example (needs the hf extra):
        >>> from lmcore import ModelConfig
        >>> config = mpt_config(ModelConfig.from_preset("tiny", bias=False), eos_token_id=2)
        >>> config.max_seq_len, config.eos_token_id, config.attn_config.alibi
        (128, 2, True)
    """
    transformers = import_hf("transformers", "the MPT export")
    bad = mpt_mismatches(config)
    if bad:
        raise ValueError(f"the model does not map onto transformers' MPT: {', '.join(bad)}")
    max_seq_len = DEFAULT_CONTEXT_MULTIPLE * config.context_length if max_seq_len is None else max_seq_len
    if not isinstance(max_seq_len, int) or max_seq_len < 1:
        raise ValueError(f"max_seq_len must be a positive int, got {max_seq_len!r}")
    return transformers.MptConfig(
        d_model=config.d_model,
        n_heads=config.n_head,
        n_layers=config.n_layer,
        expansion_ratio=4,
        max_seq_len=max_seq_len,
        vocab_size=config.vocab_size,
        layer_norm_epsilon=config.norm_eps,
        learned_pos_emb=False,
        no_bias=True,
        attn_config={"alibi": True, "alibi_bias_max": 8, "softmax_scale": None},  # no dropout: attn_pdrop 0
        tie_word_embeddings=True,
        use_cache=True,
        architectures=["MptForCausalLM"],
        **token_ids,
    )


def _weight(layer: nn.Linear | LoRALinear) -> torch.Tensor:
    return layer.base.weight if isinstance(layer, LoRALinear) else layer.weight


def _blocks(model: GPT) -> list[Block]:
    # nn.ModuleList is not generic (torch types its items as nn.Module); GPT.layers holds Blocks only.
    return [cast("Block", block) for block in model.layers]


def mpt_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """The weights of `model` under MPT's names (base weights only when it has LoRA adapters); tensors other than
    the fused `Wqkv` share storage with the model.

    Example:
        >>> from lmcore import GPT, ModelConfig
        >>> state = mpt_state_dict(GPT(ModelConfig.from_preset("tiny", bias=False)))
        >>> sorted(state)[:2], tuple(state["transformer.blocks.0.attn.Wqkv.weight"].shape)  # q, k, v stacked
        (['transformer.blocks.0.attn.Wqkv.weight', 'transformer.blocks.0.attn.out_proj.weight'], (192, 64))
    """
    state = {"transformer.wte.weight": model.embed_tokens.weight, "transformer.norm_f.weight": model.norm.weight}
    for i, block in enumerate(_blocks(model)):
        attn, prefix = block.self_attn, f"transformer.blocks.{i}."
        state[prefix + "norm_1.weight"] = block.attn_norm.weight
        state[prefix + "attn.Wqkv.weight"] = torch.cat(
            [_weight(attn.q_proj), _weight(attn.k_proj), _weight(attn.v_proj)]
        )
        state[prefix + "attn.out_proj.weight"] = _weight(attn.o_proj)
        state[prefix + "norm_2.weight"] = block.mlp_norm.weight
        state[prefix + "ffn.up_proj.weight"] = _weight(block.mlp.up_proj)
        state[prefix + "ffn.down_proj.weight"] = _weight(block.mlp.down_proj)
    return {k: v.detach() for k, v in state.items()}


def to_mpt(model: GPT, max_seq_len: int | None = None, **token_ids: int | None) -> Any:
    """`transformers.MptForCausalLM` in eval mode computing what `model` computes (its base when it has adapters),
    in the model's dtype and on its device; `hf.save_pretrained(dir)` writes a directory that
    `AutoModelForCausalLM.from_pretrained(dir)` loads without custom code.

    Example (needs the hf extra):
        >>> import torch
        >>> from lmcore import GPT, ModelConfig
        >>> model = GPT(ModelConfig.from_preset("tiny", bias=False)).eval()
        >>> hf = to_mpt(model, eos_token_id=2)
        >>> ids = torch.randint(0, 97, (1, 40))  # longer than the training context of 32
        >>> type(hf).__name__, torch.allclose(hf(ids).logits, model(ids).logits, atol=1e-5)
        ('MptForCausalLM', True)
    """
    transformers = import_hf("transformers", "the MPT export")
    config = mpt_config(model.config, max_seq_len, **token_ids)
    with torch.device("meta"):
        hf = transformers.MptForCausalLM(config)
    missing, unexpected = hf.load_state_dict(mpt_state_dict(model), strict=False, assign=True)
    if unexpected or set(missing) != {"lm_head.weight"}:
        raise RuntimeError(f"MPT weight names changed in this transformers: missing {missing}, extra {unexpected}")
    hf.lm_head.weight = hf.transformer.wte.weight
    return hf.eval()


def peft_config(model: GPT) -> Any:
    """The `peft.LoraConfig` of the adapters of `model` on its MPT export.

    MPT fuses q, k and v into one `Wqkv`, so the adapters of those targeted become one LoRA of rank
    `r * (number of them)` (A stacked, B block-diagonal) with alpha scaled alike: alpha / r is unchanged and the
    update is exactly the sum of the separate ones.
    """
    peft = import_hf("peft", "the PEFT adapter export")
    settings = model.lora_settings
    unmapped = sorted(set(settings["targets"]) - set(MPT_MODULES))
    if unmapped:
        raise ValueError(f"LoRA targets {unmapped} have no MPT module (MPT has no gate_proj)")
    n_qkv = len({"q_proj", "k_proj", "v_proj"} & set(settings["targets"]))
    targets = sorted({MPT_MODULES[t].split(".")[-1] for t in settings["targets"]})
    return peft.LoraConfig(
        r=settings["r"],
        lora_alpha=settings["alpha"],
        lora_dropout=settings["dropout"],
        target_modules=targets,
        rank_pattern={"Wqkv": settings["r"] * n_qkv} if n_qkv else {},
        alpha_pattern={"Wqkv": settings["alpha"] * n_qkv} if n_qkv else {},
        bias="none",
        task_type="CAUSAL_LM",
    )


@torch.no_grad()
def to_peft(model: GPT, hf: Any, base_name_or_path: str | None = None) -> Any:
    """Wrap `hf` (from `to_mpt(model)`; modified in place) in a `peft.PeftModel` holding the adapters of `model`;
    `peft_model.save_pretrained(dir)` writes `adapter_config.json` and `adapter_model.safetensors`, which
    `PeftModel.from_pretrained(base, dir)` loads onto the exported base.

    Example (needs the hf extra):
        >>> import torch
        >>> from lmcore import GPT, ModelConfig, apply_lora
        >>> lora_model = apply_lora(GPT(ModelConfig.from_preset("tiny", bias=False)), r=4).eval()
        >>> _ = torch.nn.init.normal_(lora_model.layers[0].self_attn.q_proj.lora_B)  # as if trained
        >>> peft_model = to_peft(lora_model, to_mpt(lora_model))
        >>> ids = torch.randint(0, 97, (1, 16))
        >>> torch.allclose(peft_model(ids).logits, lora_model(ids).logits, atol=1e-5)
        True
    """
    peft = import_hf("peft", "the PEFT adapter export")
    adapters = lora_modules(model)
    if not adapters:
        raise ValueError("the model has no LoRA adapters to export")
    if base_name_or_path is not None:
        hf.name_or_path = base_name_or_path  # what PEFT records as `base_model_name_or_path`
    peft_model = peft.get_peft_model(hf, peft_config(model))
    r, d = model.lora_settings["r"], model.config.d_model
    for i, block in enumerate(_blocks(model)):
        attn, mpt_block = block.self_attn, peft_model.base_model.model.transformer.blocks[i]
        # Wqkv's output rows: q at [0, d), k at [d, 2d), v at [2d, 3d) (n_kv_head = n_head in an MPT export).
        qkv = [(j * d, m) for j, m in enumerate((attn.q_proj, attn.k_proj, attn.v_proj)) if isinstance(m, LoRALinear)]
        if qkv:
            fused = mpt_block.attn.Wqkv
            a, b = fused.lora_A["default"].weight, fused.lora_B["default"].weight  # (n r, d), (3 d, n r)
            b.zero_()
            for slot, (row, adapter) in enumerate(qkv):
                a[slot * r : (slot + 1) * r] = adapter.lora_A
                b[row : row + d, slot * r : (slot + 1) * r] = adapter.lora_B
        for layer, path in ((attn.o_proj, "attn.out_proj"), (block.mlp.up_proj, "ffn.up_proj"),
                            (block.mlp.down_proj, "ffn.down_proj")):  # fmt: skip
            if isinstance(layer, LoRALinear):
                target = mpt_block.get_submodule(path)
                target.lora_A["default"].weight.copy_(layer.lora_A)
                target.lora_B["default"].weight.copy_(layer.lora_B)
    return peft_model.eval()
