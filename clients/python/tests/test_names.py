"""The nested-key flattening scheme, without a daemon."""

from __future__ import annotations

import random

import pytest

from ckptd import _names


@pytest.mark.parametrize(
    ("key", "escaped"),
    [
        ("layer.0.weight", "layer.0.weight"),
        ("a:b", "a%3Ab"),
        ("100%", "100%25"),
        ("a/b", "a%2Fb"),
        ("..", "%2E."),
        ("a...b", "a%2E%2E.b"),
        (".", "%2E"),
        ("tab\there", "tab%09here"),
        ("del\x7f", "del%7F"),
        ("ünï", "ünï"),
    ],
)
def test_escape_key(key, escaped):
    assert _names.escape_key(key) == escaped
    assert _names.unescape_key(escaped) == key


def test_flatten_names_are_readable_and_reverse():
    state = {
        "model": {"layer.0.weight": 1, "layer.0.bias": 2},
        "step": 3,
        "opt": {"state": {"0": {"m": 4}}},
    }
    flat = list(_names.flatten(state))
    assert flat == [
        ("model:layer.0.weight", 1),
        ("model:layer.0.bias", 2),
        ("step", 3),
        ("opt:state:0:m", 4),
    ]
    assert _names.unflatten(flat) == state


def test_flatten_distinguishes_nesting_from_keys_with_separator():
    a = {"a": {"b": 1}}
    b = {"a:b": 1}
    fa, fb = list(_names.flatten(a)), list(_names.flatten(b))
    assert fa != fb
    assert _names.unflatten(fa) == a
    assert _names.unflatten(fb) == b


def _random_key(rng: random.Random) -> str:
    alphabet = "ab.:%/\x01\x7f_-é0 "
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6)))


def _random_tree(rng: random.Random, depth: int) -> dict:
    out = {}
    for _ in range(rng.randint(1, 4)):
        key = _random_key(rng)
        out[key] = _random_tree(rng, depth - 1) if depth and rng.random() < 0.4 else rng.random()
    return out


def test_flatten_roundtrips_random_trees():
    rng = random.Random(1)
    for _ in range(500):
        tree = _random_tree(rng, 3)
        names = list(_names.flatten(tree))
        for name, _ in names:
            assert "/" not in name and ".." not in name and name != "."
            assert all(ord(c) >= 0x20 and ord(c) != 0x7F for c in name)
        assert _names.unflatten(names) == tree


@pytest.mark.parametrize(
    ("state", "error", "match"),
    [
        ([1, 2], TypeError, "must be a dict"),
        ({1: 2}, TypeError, "keys must be str"),
        ({"a": {2: 3}}, TypeError, r"in \['a'\]"),
        ({"": 1}, ValueError, "empty key"),
        ({"a": {}}, ValueError, "empty dict"),
        ({"x" * 256: 1}, ValueError, "more than the daemon's limit of 255"),
        ({"a\ud800": 1}, ValueError, "not valid Unicode"),
        ({"__metadata__": 1}, ValueError, r"'__metadata__'.*reserved by the safetensors"),
    ],
)
def test_flatten_rejects(state, error, match):
    with pytest.raises(error, match=match):
        list(_names.flatten(state))


def test_unflatten_reports_foreign_conflicts():
    with pytest.raises(ValueError, match="nested=False"):
        _names.unflatten([("a", 1), ("a:b", 2)])
    with pytest.raises(ValueError, match="nested=False"):
        _names.unflatten([("a:b", 1), ("a", 2)])


def test_unescape_keeps_stray_percent():
    assert _names.unescape_key("50%off") == "50%off"
    assert _names.unescape_key("%zz%4") == "%zz%4"


def test_reserved_name_only_at_the_top_level():
    """Nested, or as part of a longer key, __metadata__ is an ordinary name."""
    assert [n for n, _ in _names.flatten({"a": {"__metadata__": 1}, "__metadata__x": 2})] == [
        "a:__metadata__",
        "__metadata__x",
    ]


def test_safetensors_reserves_only_what_flatten_refuses():
    """Every name flatten gives survives a safetensors file; __metadata__ would not."""
    np = pytest.importorskip("numpy")
    st = pytest.importorskip("safetensors.numpy")
    names = [n for n, _ in _names.flatten(_random_tree(random.Random(2), 3))]
    names += ["a:__metadata__", "%2E", "é", " ", "x" * 255]
    loaded = st.load(st.save({n: np.zeros(1) for n in names}))
    assert sorted(loaded) == sorted(names)
    for reserved in _names.RESERVED:
        with pytest.raises(Exception, match="header"):
            st.load(st.save({reserved: np.zeros(1)}))
