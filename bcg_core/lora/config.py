"""``lora``: the adapters a replica serves per request (docs/OPERATIONS.md, "LoRA adapters")."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["LoRAConfig"]


class LoRAConfig(BaseModel):
    """LoRA adapters per request (:mod:`bcg_core.lora`). Off unless ``dir`` is set."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dir: str | None = Field(
        default=None, description="Folder of adapters: <name>.safetensors, or <name>/pytorch_lora_weights.safetensors "
        "as a diffusers pipeline's save_lora_weights writes; None: no adapters.")
    slots: int = Field(default=8, ge=1, le=256, description="Adapters resident on the GPU per replica at once.")
    max_rank: int = Field(default=64, ge=1, le=1024,
                          description="Highest rank served; every slot holds this rank (lower ranks zero-padded).")
    max_per_request: int = Field(default=4, ge=1, le=16, description="Most adapters one request may name.")
    max_scale: float = Field(default=4.0, gt=0.0, le=100.0,
                             description="Largest |scale| of an adapter in a request.")
    targets: list[str] | None = Field(
        default=None, description="fnmatch patterns of the transformer's linear layers adapters may change "
        "(e.g. 'transformer_blocks.*.attn.to_*'); None: every linear layer of the transformer.")
    load_timeout_s: float = Field(default=30.0, gt=0.0,
                                  description="Most seconds a request waits for its adapters to load (then 503).")
    host_cache: int = Field(default=32, ge=0, description="Adapters kept in host memory after they were read.")

    @model_validator(mode="after")
    def _fits(self) -> LoRAConfig:
        if self.slots < self.max_per_request:
            raise ValueError(f"lora.slots {self.slots} is below lora.max_per_request {self.max_per_request}: a request "
                             f"naming that many adapters could never have them all resident")
        return self
