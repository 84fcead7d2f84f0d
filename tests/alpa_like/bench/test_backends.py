"""The measured backends' plumbing: the scaled OPT shape and the Ray options of the CLI (the runs themselves are
tested on a multi-node Ray cluster in tests/runtime/test_ray_multinode.py)."""
import pytest

from alpa_like import models
from alpa_like.bench import backends
from alpa_like.bench.__main__ import parse_args


def test_the_scaled_opt_keeps_opt_125m_head_size_and_mlp_ratio():
    scaled, full = backends.SCALED_CONFIGS["opt-125m-scaled"], models.get_config("opt-125m")
    assert scaled.hidden_size // scaled.num_heads == full.hidden_size // full.num_heads == 64
    assert scaled.mlp_ratio == full.mlp_ratio
    assert backends.LOCAL_MODELS["opt"][0] == "opt-125m-scaled"


def test_an_address_is_for_the_ray_backend(capsys):
    assert parse_args(["opt", "--backend", "ray", "--address", "127.0.0.1:6379"]).address == "127.0.0.1:6379"
    assert parse_args(["opt", "--backend", "ray"]).address is None  # a local cluster is started
    with pytest.raises(SystemExit):
        parse_args(["opt", "--backend", "local", "--address", "127.0.0.1:6379"])
    assert "--address is for --backend ray, got --backend local" in capsys.readouterr().err
