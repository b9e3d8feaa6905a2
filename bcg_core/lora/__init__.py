"""LoRA adapters per request, batched inside the bucket graphs (docs/OPERATIONS.md, "LoRA adapters").

- :mod:`bcg_core.lora.config`: the ``lora`` config section.
- :mod:`bcg_core.lora.files`: adapter names and files, read with diffusers' own LoRA loaders.
- :mod:`bcg_core.lora.layers`: the batched per-row LoRA linear layers and their slot buffers.
- :mod:`bcg_core.lora.rows`: each row's adapters through padding, capture and replay.
- :mod:`bcg_core.lora.slots`: leases, slot eviction and loading off the denoising thread.
"""
