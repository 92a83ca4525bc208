"""`decoding_attention()`: cuDNN attention last in torch's SDPA priority order inside DSpark's decoding loops (and
the SPS profile and timed baselines), nothing else changed, everything restored afterwards."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from tiny_models import tiny_drafter, tiny_target

import dspark_hf
from dspark_hf.evaluation.compare import timed_generate
from dspark_hf.scheduling import SPSTable
from dspark_hf.serving import DSparkEngine

CUDNN = int(SDPBackend.CUDNN_ATTENTION)


def flags() -> tuple[bool, ...]:
    cuda = torch.backends.cuda
    return (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled(),
            cuda.cudnn_sdp_enabled())


def priority() -> list[int]:
    return list(torch._C._get_sdp_priority_order())


@pytest.fixture
def cudnn_first():
    """The order torch 2.11 used on the H200: cuDNN first."""
    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH,
             SDPBackend.OVERRIDEABLE]
    with sdpa_kernel(order, set_priority=True):
        assert priority()[0] == CUDNN
        yield


def test_cudnn_moves_last_and_everything_is_restored(cudnn_first):
    before_flags, before_order = flags(), priority()
    with dspark_hf.decoding_attention():
        assert priority()[-1] == CUDNN
        assert flags() == before_flags
    assert (flags(), priority()) == (before_flags, before_order)


def test_the_order_is_the_one_sdpa_kernel_would_set_and_nesting_changes_nothing(cudnn_first):
    """`decoding_attention` sets torch's priority order itself (cheaper than `sdpa_kernel`, which also saves and sets
    every backend's flag); the order is the one `sdpa_kernel(enabled, set_priority=True)` sets."""
    from dspark_hf.attention_backends import _PREFERRED, _enabled

    with sdpa_kernel([backend for backend in _PREFERRED if _enabled(backend)], set_priority=True):
        expected = priority()
    with dspark_hf.decoding_attention():
        assert priority() == expected
        with dspark_hf.decoding_attention():
            assert priority() == expected
        assert priority() == expected


def test_environment_switch_keeps_torch_order(cudnn_first, monkeypatch):
    monkeypatch.setenv("DSPARK_KEEP_SDPA_ORDER", "1")
    with dspark_hf.decoding_attention():
        assert priority()[0] == CUDNN


def test_backends_the_user_disabled_stay_disabled(cudnn_first):
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH], set_priority=True):
        with dspark_hf.decoding_attention():
            assert flags() == (False, False, True, True)
            assert priority().index(int(SDPBackend.MATH)) < priority().index(CUDNN)


@pytest.fixture
def models():
    target = tiny_target(seed=0)
    return target, tiny_drafter(target, block_size=4)


def record_orders(target) -> list[list[int]]:
    orders = []
    target.model.layers[0].self_attn.register_forward_pre_hook(lambda *unused: orders.append(priority()))
    return orders


@torch.no_grad()
def test_dspark_loops_run_with_cudnn_last(models, cudnn_first):
    target, drafter = models
    orders = record_orders(target)
    prompt = torch.tensor([[5, 6, 7, 8]])
    target.generate(prompt, max_new_tokens=6, do_sample=False)
    plain = len(orders)
    assert plain > 0 and all(order[0] == CUDNN for order in orders)  # plain generate() is left alone

    target.generate(prompt, assistant_model=drafter, max_new_tokens=6, do_sample=False)
    target.generate(torch.tensor([[5, 6, 7, 8], [0, 9, 10, 11]]), attention_mask=torch.tensor([[1] * 4, [0] + [1] * 3]),
                    assistant_model=drafter, max_new_tokens=6, do_sample=False, pad_token_id=0)
    engine = DSparkEngine(target, drafter, default_sampling={"temperature": 0})
    engine.add_request([5, 6, 7], max_tokens=6)
    engine.run()
    SPSTable.profile(target, batch_tokens=(1, 2), context_length=8, repeats=1, warmup=0, progress=False)
    timed_generate(target, prompt, max_new_tokens=2, do_sample=False)
    assert len(orders) > plain and all(order[-1] == CUDNN for order in orders[plain:])
    assert priority()[0] == CUDNN
