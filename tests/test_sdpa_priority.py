"""``model.sdpa_backends``: the order SDPA tries its kernels in, from the config to the kernel call."""

import pytest
import torch
import torch.nn.functional as F

from model_harness import small_args
from titan_ulysses.config.manager import ConfigError, load_config
from titan_ulysses.models.compute import ComputeOptions
from titan_ulysses.models.decoder.model import Transformer
from titan_ulysses.ops.attention import SDPA_KERNELS, sdpa_priority
from titan_ulysses.preflight import validate

PYTORCH_ORDER = torch._C._get_sdp_priority_order()


def test_a_list_is_a_preference_and_auto_puts_cudnn_first_on_hopper_only(monkeypatch):
    for masked in (False, True):  # a list applies to both kinds of call
        assert sdpa_priority("cudnn", masked) == ("cudnn", "flash", "efficient", "math")
        assert sdpa_priority("flash,math", masked) == ("flash", "math", "efficient", "cudnn")
        assert sdpa_priority("auto", masked) == ()  # this machine has no GPU: PyTorch's order
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for capability, want in (((9, 0), ("cudnn", "flash", "efficient", "math")), ((8, 0), ()), ((10, 0), ())):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, c=capability: c)
        assert sdpa_priority("auto") == want, capability
        # with a mask, not cuDNN (its masked backward has a NaN bug from torch 2.11 on), on every GPU
        assert sdpa_priority("auto", masked=True) == ("efficient", "flash", "math", "cudnn"), capability
    # the names map to SDPA's kernels, listed in PyTorch's own order
    assert [int(SDPA_KERNELS[n]) for n in sdpa_priority("flash")] == list(PYTORCH_ORDER)[:4]


@pytest.mark.parametrize("value,needle", [("fast", "'fast' is not a kernel"), ("cudnn,cudnn", "named twice"),
                                          ("", "'' is not a kernel")])
def test_a_wrong_value_is_refused_naming_the_setting(value, needle):
    config = load_config(["--model.sdpa_backends", value])
    with pytest.raises(ConfigError, match="model.sdpa_backends") as e:
        validate(config, 1)
    assert needle in str(e.value) and "cudnn,flash" in str(e.value)


def test_the_order_is_in_force_at_every_kernel_call_and_restored_after(monkeypatch):
    config = load_config(["--model.sdpa_backends", "cudnn,flash"])
    compute = ComputeOptions.from_config(config.model)
    assert compute.sdpa_backends == "cudnn,flash"
    seen, original = [], F.scaled_dot_product_attention

    def recording(*a, **k):
        seen.append(list(torch._C._get_sdp_priority_order()))
        return original(*a, **k)

    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (2, 16))
    outs = []
    for setting in (compute.sdpa_backends, "auto"):  # "auto" on this CPU machine: PyTorch's order
        torch.manual_seed(0)
        model = Transformer(small_args(), ComputeOptions(sdpa_backends=setting))
        model.init_weights()
        monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
        outs.append(model(tokens))
        monkeypatch.setattr(F, "scaled_dot_product_attention", original)
    wanted = [int(SDPA_KERNELS[n]) for n in sdpa_priority(compute.sdpa_backends)]
    assert [order[:4] for order in seen[:2]] == [wanted, wanted]  # both layers, in the configured order
    # (then PyTorch's OVERRIDEABLE slot, which no CUDA or CPU kernel uses)
    assert seen[2:] == [list(PYTORCH_ORDER)] * 2  # an empty order leaves PyTorch's alone
    assert list(torch._C._get_sdp_priority_order()) == list(PYTORCH_ORDER)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)  # on CPU the same kernel runs


def test_auto_picks_the_measured_kernel_per_head_dim_and_length_and_says_where_none_was_measured():
    from titan_ulysses.ops.attention.sdpa_table import MEASURED, auto_causal

    row = MEASURED[0]  # head_dim 128 on Hopper, 32K-128K: cuDNN
    assert auto_causal((9, 0), row.head_dim, row.min_len) == ((row.fastest,), row)
    assert auto_causal((9, 0), row.head_dim, row.max_len) == ((row.fastest,), row)
    # not measured: the order from before the table, and no row to stand on
    assert auto_causal((9, 0), row.head_dim, row.min_len - 1) == (("cudnn",), None)
    assert auto_causal((9, 0), 64, 16384) == (("cudnn",), None)
    assert auto_causal((8, 0), 128, 65536) == ((), None)
    assert auto_causal(None, 128, 65536) == ((), None)


def test_the_order_follows_each_calls_head_dim_and_length(monkeypatch):
    """A row naming another kernel for one (head_dim, length) range moves that kernel first for the calls
    of that shape only, inside the module's forward (the shape read from q and k as the kernel sees them)."""
    from titan_ulysses.ops.attention import sdpa, sdpa_table

    row = sdpa_table.Measured("hopper", 16, 8, 32, "efficient", "test", "test", "test", "test")
    monkeypatch.setattr(sdpa_table, "MEASURED", (row,))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    module = sdpa.SDPAAttention("auto")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU kernels run the calls below
    assert module.order(False, 16, 32)[0] == SDPA_KERNELS["efficient"]
    assert module.order(False, 16, 64)[0] == SDPA_KERNELS["cudnn"]  # beyond the row: before-the-table order
    assert module.order(True, 16, 32)[0] == SDPA_KERNELS["efficient"]  # masked calls keep their own
    seen, original = [], F.scaled_dot_product_attention

    def recording(*a, **k):
        seen.append(int(torch._C._get_sdp_priority_order()[0]))
        return original(*a, **k)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    for s in (32, 64):  # [B, S, H, D] with D 16
        module(*(torch.randn(1, s, 2, 16) for _ in range(3)))
    assert seen == [int(SDPA_KERNELS["efficient"]), int(SDPA_KERNELS["cudnn"])]
