"""A decoder-only language model with ALiBi or rotary positions: configs, presets, init schemes, LoRA, generation,
memory estimates, the CPU settings of a fast training step, and Llama-family Hugging Face checkpoints in and out."""

from lmcore.compiled import compile_model
from lmcore.config import PRESETS, ModelConfig, flops_per_token, n_params
from lmcore.cpu_math import MatmulProbe, cpu_has_native_bf16, cpu_matmul_library, route_cpu_matmuls
from lmcore.documents import Documents, document_boundaries, document_starts
from lmcore.finetune_memory import FinetuneEstimate, estimate_finetune_memory
from lmcore.generation import generate
from lmcore.hf_export import save_hf, save_peft_adapter
from lmcore.hf_import import from_hf
from lmcore.hf_llama import HFImportError, HFSource
from lmcore.init_schemes import (
    INIT_FUNCTIONS,
    InitReport,
    init_gpt2,
    init_kaiming,
    init_report,
    init_small,
    init_xavier,
    initialize,
)
from lmcore.lora import LoRALinear, apply_lora, load_lora, lora_state, merge_lora, save_lora
from lmcore.memory import MemoryEstimate, estimate_fsdp_memory, estimate_memory
from lmcore.model import GPT, KVCache, LMOutput, check_token_ids
from lmcore.step_timing import StepTiming, choose_threads, time_step
from lmcore.version import __version__

__all__ = [
    "GPT",
    "HFImportError",
    "HFSource",
    "INIT_FUNCTIONS",
    "PRESETS",
    "StepTiming",
    "Documents",
    "FinetuneEstimate",
    "InitReport",
    "KVCache",
    "LMOutput",
    "LoRALinear",
    "MatmulProbe",
    "MemoryEstimate",
    "ModelConfig",
    "__version__",
    "apply_lora",
    "check_token_ids",
    "choose_threads",
    "compile_model",
    "cpu_has_native_bf16",
    "cpu_matmul_library",
    "document_boundaries",
    "document_starts",
    "estimate_finetune_memory",
    "estimate_fsdp_memory",
    "estimate_memory",
    "flops_per_token",
    "from_hf",
    "generate",
    "init_gpt2",
    "init_kaiming",
    "init_report",
    "init_small",
    "init_xavier",
    "initialize",
    "load_lora",
    "merge_lora",
    "n_params",
    "route_cpu_matmuls",
    "save_hf",
    "save_lora",
    "save_peft_adapter",
    "lora_state",
    "time_step",
]
