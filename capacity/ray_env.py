"""Environment variables a Ray Serve application's runtime_env must carry for SGLang's Ray
backend, per GPU vendor: the one table that `kimi-capacity emit` writes into its Serve files and
that the app's SGLang backend checks at start-up (`serve_app.engines.sglang.runtime_env_vars`).

SGLang's Ray engine reads the GPU Ray assigned to each scheduler actor and selects it itself, so
Ray must leave every GPU visible (SGLang 0.5.23, srt/ray/engine.py). On AMD nodes Ray 2.60
narrows HIP_VISIBLE_DEVICES instead of CUDA_VISIBLE_DEVICES (ray/_private/accelerators/
amd_gpu.py), so both are set there.
"""

from __future__ import annotations

from capacity.tables import gpu_vendor

NOSET_CUDA_ENV = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
NOSET_HIP_ENV = "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES"

# gpus.csv's `vendor` column -> the variables (each set to "1").
NOSET_ENV_BY_VENDOR: dict[str, tuple[str, ...]] = {
    "NVIDIA": (NOSET_CUDA_ENV,),
    "AMD": (NOSET_CUDA_ENV, NOSET_HIP_ENV),
}


def sglang_ray_env(gpu: str | None, ragged_verify_mode: str = "static") -> dict[str, str]:
    """The runtime_env env_vars SGLang's Ray backend needs on this GPU's nodes, and the
    adaptive DSpark verify's mode where it is not SGLang's default (capacity/dspark_verify.py:
    SGLang reads it from the environment, not from its arguments)."""
    from capacity.dspark_verify import RAGGED_VERIFY_ENV

    vendor = gpu_vendor(gpu)
    if vendor not in NOSET_ENV_BY_VENDOR:
        from capacity.errors import CapacityError

        raise CapacityError(f"GPU {gpu!r}: vendor {vendor!r} has no Ray environment entry; "
                            f"known: {', '.join(NOSET_ENV_BY_VENDOR)}")
    env = dict.fromkeys(NOSET_ENV_BY_VENDOR[vendor], "1")
    if ragged_verify_mode != "static":
        env[RAGGED_VERIFY_ENV] = ragged_verify_mode
    return env
