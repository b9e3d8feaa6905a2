"""``install_processors`` (``bcg_core/families/helpers.py``), the attention-processor swap of the Qwen-Image and
Qwen-Image 2.1 adapters: the stock processor (that class exactly) is replaced, a block already holding the bucket
processor keeps that very object (an adapter built twice on one transformer), and any other processor, a subclass of
the stock one included, is refused with the adapter's message. On stand-in blocks: no model is built."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bcg_core.families.helpers import install_processors


class Stock:
    """Stands for diffusers' processor (``QwenDoubleStreamAttnProcessor2_0``)."""


class CustomStock(Stock):
    """A processor a caller derived from the stock one: not the forward the adapter was written against."""


class Bucket:
    """Stands for the bucket forward's processor (``TextMaskAttnProcessor``)."""


class Attn:
    def __init__(self, processor):
        self.processor = processor

    def set_processor(self, processor):
        self.processor = processor


def _blocks(*processors):
    return [SimpleNamespace(attn=Attn(p)) for p in processors]


def test_the_stock_processor_is_replaced_and_an_installed_one_kept():
    kept = Bucket()
    blocks = _blocks(Stock(), kept, Stock())
    install_processors(blocks, Stock, Bucket, "XAdapter")
    assert [type(b.attn.processor) for b in blocks] == [Bucket, Bucket, Bucket]
    assert blocks[1].attn.processor is kept
    first = [b.attn.processor for b in blocks]
    install_processors(blocks, Stock, Bucket, "XAdapter")  # built again on the same transformer: nothing changes
    assert all(b.attn.processor is p for b, p in zip(blocks, first, strict=True))


@pytest.mark.parametrize("foreign", [CustomStock, object])
def test_another_processor_is_refused_naming_it_and_the_stock_class(foreign):
    blocks = _blocks(Stock(), foreign())
    with pytest.raises(ValueError, match=f"^XAdapter needs the stock Stock on every block, found {foreign.__name__}$"):
        install_processors(blocks, Stock, Bucket, "XAdapter")
    assert type(blocks[0].attn.processor) is Bucket  # the blocks before it were swapped, as the loop did
