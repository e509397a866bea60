"""Nested state dicts ⇄ dotted FQNs, as an optimizer state dict nests them."""

from __future__ import annotations

import collections
import pickle

import pytest
import torch

from hyper_parallel_dcp.core.flatten import flatten_state_dict, set_by_path, unflatten_state_dict
from hyper_parallel_dcp.core.layout import is_tensor_leaf

Moments = collections.namedtuple("Moments", "first second")


def _optimizer_like():
    return {
        "moments": Moments(torch.ones(2), torch.zeros(2)),
        "model": {"layer.weight": torch.arange(6.0).view(2, 3), "layer.bias": torch.ones(2)},
        "optim": {
            "state": {
                "layer.weight": {"step": torch.tensor(3.0), "exp_avg": torch.full((2, 3), 0.5)},
                "layer.bias": {"step": torch.tensor(3.0), "exp_avg": torch.zeros(2)},
            },
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["layer.weight", "layer.bias"]}],
        },
        "pair": (torch.tensor([1, 2]), 7),
        "mixed": [torch.zeros(1), {"inner": torch.ones(1)}, "tag"],
        "plain_list": [1, 2, 3],
        "empty": {},
        "step": 12,
    }


EXPECTED_FQNS = {
    "model.layer.weight", "model.layer.bias",
    "optim.state.layer.weight.step", "optim.state.layer.weight.exp_avg",
    "optim.state.layer.bias.step", "optim.state.layer.bias.exp_avg",
    "optim.param_groups",  # a list without tensors is one leaf
    "pair.0", "pair.1",
    "mixed.0", "mixed.1.inner", "mixed.2",
    "plain_list", "empty", "step", "moments.0", "moments.1",
}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_flatten_gives_dotted_fqns_and_leaves_by_identity():
    sd = _optimizer_like()
    flat, paths = flatten_state_dict(sd, is_tensor_leaf)
    assert set(flat) == EXPECTED_FQNS
    assert flat["optim.state.layer.weight.exp_avg"] is sd["optim"]["state"]["layer.weight"]["exp_avg"]
    assert flat["optim.param_groups"] is sd["optim"]["param_groups"]
    assert flat["pair.1"] == 7 and flat["mixed.2"] == "tag"
    assert paths["optim.state.layer.weight.step"] == ("optim", "state", "layer.weight", "step")
    assert paths["mixed.1.inner"] == ("mixed", 1, "inner")


def test_unflatten_round_trip_restores_containers_and_types():
    sd = _optimizer_like()
    flat, paths = flatten_state_dict(sd, is_tensor_leaf)
    back = unflatten_state_dict(flat, paths)
    assert _same(back, sd)
    assert back["optim"]["param_groups"] is sd["optim"]["param_groups"]  # leaves are not copied
    # paths survive pickling (the async writer ships them to another process)
    assert _same(unflatten_state_dict(flat, pickle.loads(pickle.dumps(paths))), sd)


def test_unflatten_keeps_integer_dict_keys_apart_from_list_positions():
    """torch optimizers key ``state`` by parameter index: a dict with int keys, not a list."""
    sd = {"state": {0: {"exp_avg": torch.ones(2)}, 2: {"exp_avg": torch.zeros(2)}},
          "buffers": [torch.ones(1), torch.zeros(1)]}
    flat, paths = flatten_state_dict(sd, is_tensor_leaf)
    assert set(flat) == {"state.0.exp_avg", "state.2.exp_avg", "buffers.0", "buffers.1"}
    back = unflatten_state_dict(flat, paths)
    assert _same(back, sd)


def test_set_by_path_replaces_leaves_in_place_through_tuples():
    Point = collections.namedtuple("Point", "x y")
    sd = {"a": {"b": [1, (torch.zeros(1), "old")]}, "p": Point(torch.zeros(1), 5)}
    inner_list = sd["a"]["b"]
    flat, paths = flatten_state_dict(sd, is_tensor_leaf)
    sd["a"] = set_by_path(sd["a"], paths["a.b.1.1"][1:], "new")
    sd["p"] = set_by_path(sd["p"], paths["p.1"][1:], 6)
    assert sd["a"]["b"] is inner_list  # the list itself was mutated, not copied
    assert sd["a"]["b"][1][1] == "new" and type(sd["a"]["b"][1]) is tuple
    assert type(sd["p"]) is Point and sd["p"].y == 6

    class Pair(tuple):  # a tuple subclass that is not a namedtuple
        pass

    holder = {"pair": Pair((torch.zeros(1), "a"))}
    holder["pair"] = set_by_path(holder["pair"], (1,), "b")
    assert type(holder["pair"]) is Pair and holder["pair"][1] == "b"


def test_colliding_fqns_are_refused_naming_both_paths():
    sd = {"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}}
    with pytest.raises(ValueError, match=r"'a\.b'"):
        flatten_state_dict(sd, is_tensor_leaf)
