"""What Megatron-DeepSpeed's save_checkpoint puts beside the weights, read with no code run.

Its model-states files carry ``args`` (an ``argparse.Namespace``, Megatron enums among the
values), ``rng_state`` (``random``'s, numpy's and torch's generator states) and ``module`` as
``state_dict_for_save_checkpoint`` nests it. Each is read through zerofast's restricted loader, by
the native reader and by the Python one, and each stand-in refuses what the real object would
never hold. The real saves of this kind are in tests/test_megatron_tp.py.
"""
from __future__ import annotations

import argparse
import pickle
import random
import types

import numpy as np
import pytest
import torch

from zerofast.base.errors import CorruptCheckpointError, UnsafeCheckpointError, UnsupportedCheckpointError
from zerofast.load import load_file
from zerofast.load.records import MAX_MODULE_DEPTH, read_model_states

READERS = ["native", "python"]


@pytest.fixture(params=READERS)
def reader(request, monkeypatch):
    if request.param == "native":
        pytest.importorskip("zerofast.native.ops").native_module() or pytest.skip(
            "the native core is not built here (ZEROFAST_NATIVE=1 in make test builds it)")
    monkeypatch.setenv("ZEROFAST_NATIVE", "1" if request.param == "native" else "0")
    return request.param


class _Global:
    """Pickles as ``module.name(*args)``: a hand-made call of a global name, written by
    :class:`_Pickler` without importing or touching the module."""

    def __init__(self, module, name, *args):
        self.fake = type(name, (), {"_zf_global": (module, name)})
        self.args = args

    def __reduce__(self):
        return self.fake, self.args


class _Pickler(pickle._Pickler):
    def save_global(self, obj, name=None):
        spec = getattr(obj, "_zf_global", None)
        if spec is None:
            return super().save_global(obj, name)
        self.write(pickle.GLOBAL + f"{spec[0]}\n{spec[1]}\n".encode())
        self.memoize(obj)

    dispatch = pickle._Pickler.dispatch.copy()
    dispatch[type] = save_global


_PICKLE = types.SimpleNamespace(Pickler=_Pickler, __name__="pickle")


def save(obj, path):
    torch.save(obj, path, pickle_module=_PICKLE)


def megatron_states(module=None):
    args = argparse.Namespace(num_layers=2, hidden_size=8, tensor_model_parallel_size=2, params_dtype=torch.bfloat16,
                              data_path=["a", "b"], lr_decay_style="cosine", seed=1234, fp16=False)
    rng = [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": None, "rng_tracker_states": {}}]
    weight = torch.arange(6.0).reshape(2, 3)
    module = module if module is not None else {"language_model": {
        "embedding": {"word_embeddings": {"weight": weight}},
        "encoder": {"layers.0.input_layernorm.weight": torch.ones(3), "final_layernorm.bias": torch.zeros(3)}}}
    return {"module": module, "args": args, "rng_state": rng, "checkpoint_version": 3.0, "iteration": 7,
            "np_scalar": np.float64(0.5)}


def test_args_rng_states_and_a_nested_module_are_read(reader, tmp_path):
    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save(megatron_states(), path)
    raw = load_file(path)
    args = raw["args"]
    assert (args.num_layers, args.hidden_size, args.params_dtype, args.data_path) == (2, 8, torch.bfloat16, ["a", "b"])
    state = raw["rng_state"][0]["np_rng_state"]
    assert state[0] == "MT19937" and state[1].shape == (624,) and len(state[1].data) == 624 * 4
    version, internal, gauss = raw["rng_state"][0]["random_rng_state"]
    assert version == 3 and len(internal) == 625 and gauss is None
    states = read_model_states(path)
    assert list(states.module) == ["language_model.embedding.word_embeddings.weight",
                                   "language_model.encoder.layers.0.input_layernorm.weight",
                                   "language_model.encoder.final_layernorm.bias"]
    assert torch.equal(states.module["language_model.embedding.word_embeddings.weight"], torch.arange(6.0).reshape(2, 3))


def test_the_numpy_state_keeps_its_bytes(reader, tmp_path):
    path = tmp_path / "states.pt"
    np.random.seed(7)
    want = np.random.get_state()
    torch.save({"np": want}, path)
    got = load_file(path)["np"]
    assert got[1].data == want[1].tobytes() and got[1].dtype.spec == "u4" and got[2:] == tuple(want[2:])


@pytest.mark.parametrize("value, refused", [
    (_Global("numpy", "dtype", "u4" * 20, False, True), "numpy.dtype"),
    (_Global("_codecs", "encode", "abc", "utf-8"), "_codecs.encode"),
    (_Global("numpy._core.multiarray", "_reconstruct", "not ndarray", (0,), b"b"), "_reconstruct"),
    (_Global("numpy._core.multiarray", "scalar", "no dtype", b"\0" * 8), "numpy.scalar"),
    (_Global("megatron.model.enums", "PositionEmbeddingType", [1]), "PositionEmbeddingType"),
    (_Global("argparse", "Namespace", print), "builtins.print"),
    (argparse.Namespace(held={1, 2}), "argparse.Namespace"),
])
def test_stand_ins_refuse_what_the_real_objects_never_hold(reader, tmp_path, value, refused):
    path = tmp_path / "hostile.pt"
    save({"args": value}, path)
    with pytest.raises(UnsafeCheckpointError, match=refused):
        load_file(path)


def test_an_object_array_is_refused(reader, tmp_path):
    path = tmp_path / "objects.pt"
    torch.save({"np": np.array([print, 1], dtype=object)}, path)
    with pytest.raises(UnsafeCheckpointError):
        load_file(path)


def test_a_module_nested_past_the_bound_is_refused(tmp_path):
    deep = torch.ones(1)
    for i in range(MAX_MODULE_DEPTH + 2):
        deep = {f"m{i}": deep}
    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save(megatron_states(module=deep), path)
    with pytest.raises(UnsupportedCheckpointError, match="nested at most"):
        read_model_states(path)


def test_a_nested_module_that_names_a_tensor_twice_is_corrupt(tmp_path):
    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save(megatron_states(module={"a": {"b": torch.ones(1)}, "a.b": torch.ones(1)}), path)
    with pytest.raises(CorruptCheckpointError, match="twice"):
        read_model_states(path)


def test_enum_members_read_as_their_values(reader, tmp_path):
    path = tmp_path / "enums.pt"
    save({"args": argparse.Namespace(position_embedding_type=_Global(
        "megatron.model.enums", "PositionEmbeddingType", 2))}, path)
    member = load_file(path)["args"].position_embedding_type
    assert (member.enum, member.value) == ("PositionEmbeddingType", 2)


def test_a_pickle_of_the_stand_ins_runs_nothing_else(tmp_path):
    """The names stay refused where they are not the stand-ins' (os.system beside numpy's)."""
    path = tmp_path / "x.pt"
    save({"a": np.random.get_state(), "b": _Global("os", "system", "true")}, path)
    with pytest.raises(UnsafeCheckpointError, match="os.system|posix.system"):
        load_file(path)
    assert pickle.HIGHEST_PROTOCOL >= 2
