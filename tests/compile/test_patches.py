"""The registry of forward replacements (``hf_paged/compile/_patches.py``): what a patch replaces is what comes back."""

from __future__ import annotations

import pytest
import torch

from hf_paged.compile import _patches as patches


def _scaled(factor: float):
    def make(eager):
        return lambda x: eager(x) * factor
    return make


def test_patches_stack_and_come_off_in_reverse_with_the_forward_they_replaced():
    torch.manual_seed(0)
    linear = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    plain = linear(x)
    hook = lambda x: torch.nn.functional.linear(x, linear.weight, linear.bias) + 1  # noqa: E731
    linear.forward = hook  # an instance forward someone else set: kept under the patches and given back
    first = patches.install(linear, "compiled_layers", _scaled(2.0))
    second = patches.install(linear, "skinny_linears", _scaled(3.0))
    assert torch.allclose(linear(x), (plain + 1) * 6)
    assert patches.patch_of(linear, "compiled_layers") is first and patches.patch_of(linear, "skinny_linears") is second
    assert patches.install(linear, "compiled_layers", _scaled(5.0)) is first  # one patch per kind: kept
    assert patches.patched([linear, torch.nn.Linear(1, 1)], "skinny_linears") == [linear]
    assert patches.restore([linear], "skinny_linears") == 1
    assert torch.allclose(linear(x), (plain + 1) * 2) and patches.patch_of(linear, "skinny_linears") is None
    patches.install(linear, "skinny_linears", _scaled(3.0))
    assert patches.restore([linear], "compiled_layers") == 1  # and the patch stacked on it
    assert linear.__dict__["forward"] is hook and torch.allclose(linear(x), plain + 1)
    assert patches.patch_of(linear, "skinny_linears") is None and patches.restore([linear], "tp_logits") == 0


def test_a_patch_on_a_plain_module_comes_off_to_its_class_forward():
    linear = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    plain = linear(x)
    patches.install(linear, "tp_linears", _scaled(-1.0))
    assert torch.allclose(linear(x), -plain)
    patches.restore([linear], "tp_linears")
    assert "forward" not in linear.__dict__ and torch.equal(linear(x), plain)


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="unknown patch kind"):
        patches.install(torch.nn.Linear(1, 1), "mine", _scaled(1.0))


def test_patches_of_other_attributes_stack_with_forward_patches_and_come_off_to_what_was_there():
    """optimize_generate's kinds replace other attributes (``generate``, ``get_compiled_call``, ...): restoring the
    first kind puts back the instance value set before and the class's, and takes off the forward patch stacked later,
    while patch_of finds each kind's value, whatever patches of other attributes came after it."""
    module = torch.nn.Linear(2, 2)
    x = torch.randn(1, 2)
    plain = module(x)
    mine = lambda: "theirs"  # noqa: E731 - an instance attribute someone else set
    module.generate = mine
    replaced = patches.install(module, "generate", lambda current: lambda: ("patched", current()), "generate")
    masks = patches.install(module, "generate_masks", lambda current: "masks", "create_masks_for_generate")
    forward = patches.install(module, "packed_prefill", _scaled(2.0))
    assert module.generate() == ("patched", "theirs") and module.create_masks_for_generate == "masks"
    assert torch.allclose(module(x), 2 * plain)
    assert [patches.patch_of(module, k) for k in ("generate", "generate_masks", "packed_prefill")] == [
        replaced, masks, forward]
    assert patches.restore([module], "generate") == 1
    assert module.__dict__["generate"] is mine and "create_masks_for_generate" not in module.__dict__
    assert "forward" not in module.__dict__ and "_hf_paged_patches" not in module.__dict__
    assert torch.equal(module(x), plain)
