"""Memory that settles (issue 45, part 5): what a replica keeps per request shape stays within a stated bound,
however many distinct shapes clients send (``docs/RELIABILITY.md``, the mixed soak)."""

import torch
from diffusers import FluxTransformer2DModel

from bcg_core import FluxAdapter
from bcg_core.families.flux import IDS_CACHE_GRIDS, flux_image_ids


def _adapter() -> FluxAdapter:
    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=24, pooled_projection_dim=24, guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),
    ).eval()
    return FluxAdapter(model, native_text_tokens=12)


def test_flux_image_ids_keep_at_most_the_stated_number_of_grids():
    adapter = _adapter()
    cpu = torch.device("cpu")
    grids = [(h, w) for h in range(1, 21) for w in range(1, 21)]  # 400 distinct request sizes
    assert len(grids) > 4 * IDS_CACHE_GRIDS
    first = adapter.image_ids(grids[0], cpu, torch.float32)
    assert adapter.image_ids(grids[0], cpu, torch.float32) is first  # cached
    kept = []
    for g in grids:
        kept.append(adapter.image_ids(g, cpu, torch.float32))
    # the last IDS_CACHE_GRIDS grids are still the cached tensors (asked newest first, so none is evicted before it
    # is asked), every older one was dropped: an unbounded cache would keep all 400
    alive = sum(adapter.image_ids(g, cpu, torch.float32) is t
                for g, t in zip(reversed(grids), reversed(kept), strict=True))
    assert alive == IDS_CACHE_GRIDS
    again = adapter.image_ids(grids[0], cpu, torch.float32)
    assert again is not first and torch.equal(again, flux_image_ids(grids[0]))  # computed anew, still right

def test_a_recently_used_grid_is_kept_while_others_come_and_go():
    adapter = _adapter()
    cpu = torch.device("cpu")
    hot = adapter.image_ids((8, 8), cpu, torch.float32)
    for i in range(3 * IDS_CACHE_GRIDS):
        adapter.image_ids((1, i + 1), cpu, torch.float32)
        assert adapter.image_ids((8, 8), cpu, torch.float32) is hot  # used every time: never the oldest
