"""`lmtrain doctor --preset`: the memory per GPU under each engine, and which of them fit the GPUs it sees."""

from lmtrain.doctor import check_memory
from lmtrain.model_setup import estimate_run_memory

GIB = 1024**3


def test_doctor_names_the_engines_that_fit_the_gpus():
    fsdp = estimate_run_memory("1.3b", n_gpus=16, engine="fsdp")[1]
    zero2 = estimate_run_memory("1.3b", n_gpus=16)[1]
    assert zero2 < fsdp < 24 * GIB  # the recipe accumulates 4 micro-batches: FSDP keeps 4 bytes/parameter of them
    (roomy,), _ = check_memory("1.3b", [{"memory_total": 24 * GIB}], 16)
    assert roomy.status == "OK" and "fsdp (--engine fsdp)" in roomy.detail and "deepspeed ZeRO-2" in roomy.detail
    (tight,), _ = check_memory("1.3b", [{"memory_total": int((zero2 + fsdp) / 2)}], 16)
    assert "fits" in tight.detail and "--engine fsdp)" not in tight.detail and "deepspeed ZeRO-2" in tight.detail
    (none,), _ = check_memory("1.3b", [{"memory_total": 2 * GIB}], 16)
    assert none.status == "FAIL" and "none fits 2.0 GiB" in none.detail and "checkpointing=block" in none.fix
