"""A model directory read shard by shard, and the trained policy written back tensor by tensor.

Two architecture families (Qwen2 with tied embeddings saved in bfloat16 in one file, Llama with
untied embeddings saved in float32 across several files), on one rank and on two gloo ranks:

- every rank builds the model on the meta device and reads only its own rows of each tensor
  (the reads are counted), and the filled model equals ``from_pretrained``'s in the built dtype,
  rotary buffers and tied embeddings included;
- a frozen reference and a LoRA base are held in bfloat16, sharded, with no float32 copy;
- the policy written by every rank together loads with ``AutoModelForCausalLM`` and equals the
  trainer's weights in the saved dtype (a LoRA policy: merged, as ``peft`` merges it), and
  saving leaves the live weights untouched.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from streamrl.errors import ConfigError
from streamrl.policy.lora import LoRASpec, apply_lora
from streamrl.policy.model_dir import directory_dtype, empty_model, materialize, source_dir

pytestmark = pytest.mark.timeout(300)

SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def _write(path: Path, family: str, dtype: torch.dtype, tied: bool, split: bool) -> Path:
    config_class = Qwen2Config if family == "qwen2" else LlamaConfig
    config = config_class(vocab_size=301, tie_word_embeddings=tied, **SHAPE)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    model.save_pretrained(path, max_shard_size="60KB" if split else "5GB")
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("model_dirs")
    return {
        "qwen2": _write(root / "qwen2", "qwen2", torch.bfloat16, tied=True, split=False),
        "llama": _write(root / "llama", "llama", torch.float32, tied=False, split=True),
    }


def test_the_directories_are_what_the_cases_need(dirs):
    assert directory_dtype(dirs["qwen2"]) == torch.bfloat16
    assert directory_dtype(dirs["llama"]) == torch.float32
    assert len(list(dirs["llama"].glob("*.safetensors"))) > 1
    assert len(list(dirs["qwen2"].glob("*.safetensors"))) == 1


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_one_rank_reads_the_directory_as_from_pretrained_does(dirs, family):
    model = empty_model(dirs[family], torch.float32)
    assert all(p.is_meta for p in model.parameters())
    assert source_dir(model) == dirs[family]
    materialize(model, dirs[family], "cpu")
    expected = AutoModelForCausalLM.from_pretrained(dirs[family], dtype=torch.float32)
    _assert_same_model(model, expected)
    tied = model.config.tie_word_embeddings
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    ids = torch.randint(0, 300, (2, 9))
    torch.testing.assert_close(model(ids).logits, expected(ids).logits, rtol=0, atol=0)


def test_a_directory_without_safetensors_or_a_tensor_is_refused(dirs, tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    (empty / "config.json").write_text((dirs["qwen2"] / "config.json").read_text())
    with pytest.raises(ConfigError, match=r"no \.safetensors file"):
        materialize(empty_model(empty, torch.float32), empty, "cpu")
    config = (dirs["qwen2"] / "config.json").read_text()
    untied = tmp_path / "untied"
    untied.mkdir()
    (untied / "config.json").write_text(
        config.replace('"tie_word_embeddings": true', '"tie_word_embeddings": false')
    )
    (untied / "model.safetensors").symlink_to(dirs["qwen2"] / "model.safetensors")
    with pytest.raises(ConfigError, match=r"lacks 1 of the model.s tensors.*lm_head\.weight"):
        materialize(empty_model(untied, torch.float32), untied, "cpu")


def test_apply_lora_starts_the_same_adapters_on_the_meta_path_and_in_memory(dirs):
    spec = LoRASpec(r=4, target_modules=("q_proj", "v_proj"))
    in_memory = apply_lora(AutoModelForCausalLM.from_pretrained(dirs["qwen2"]), spec, seed=3)
    meta = apply_lora(empty_model(dirs["qwen2"], torch.bfloat16), spec)
    materialize(meta, dirs["qwen2"], "cpu", seed=3)
    adapters = {n: p for n, p in meta.named_parameters() if "lora_" in n}
    assert adapters and all(p.dtype == torch.float32 for p in adapters.values())
    expected = dict(in_memory.named_parameters())
    for name, param in adapters.items():
        assert torch.equal(param, expected[name]), name
        assert (param == 0).all() == (".lora_B." in name), name  # B starts at 0, A does not
    base = [p for n, p in meta.named_parameters() if "lora_" not in n]
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in base)


def test_saving_one_rank_leaves_the_live_weights_alone(dirs, tmp_path):
    from streamrl.training.policy_save import save_policy_shards

    spec = LoRASpec(r=4, target_modules=("q_proj",))
    policy = apply_lora(AutoModelForCausalLM.from_pretrained(dirs["llama"]), spec)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_()
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    out = save_policy_shards(policy, tmp_path / "saved", dtype=torch.float32)
    assert all(torch.equal(p, before[n]) for n, p in policy.named_parameters())
    merged = dict(AutoModelForCausalLM.from_pretrained(out).named_parameters())
    reference = policy.merge_and_unload()  # peft's merge, for comparison
    for name, param in reference.named_parameters():
        torch.testing.assert_close(merged[name], param, rtol=0, atol=1e-6)


def _assert_same_model(model: torch.nn.Module, expected: torch.nn.Module) -> None:
    params = dict(expected.named_parameters())
    for name, param in model.named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        assert full.dtype == param.dtype
        assert torch.equal(full, params[name].to(full.dtype)), name
    buffers = dict(expected.named_buffers())
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, buffers[name]), name


# -- two gloo ranks -------------------------------------------------------------------------------


def _two_ranks(rank: int, port: int, dirs: dict[str, Path], out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        results = {
            family: _sharded_case(rank, dirs[family], out / family) for family in ("qwen2", "llama")
        }
        torch.save(results, out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _sharded_case(rank: int, path: Path, out: Path) -> dict:
    """Load sharded (counting the rows read), check, write it back together; what was read."""
    from torch.distributed.device_mesh import init_device_mesh

    import streamrl.policy.model_dir as model_dir
    from streamrl.components.training.reference import FrozenCopy, reference_policy
    from streamrl.components.training.sharding import shard_model
    from streamrl.training.policy_save import save_policy_shards

    read = []
    original = model_dir._read_rows

    def counted(f, data_start, entry, item, target):  # every read of the reader, counted
        read.append((item.storage_index.fqn, tuple(item.lengths)))
        return original(f, data_start, entry, item, target)

    model_dir._read_rows = counted
    mesh = init_device_mesh("cpu", (2,))
    policy = empty_model(path, torch.float32)
    reference = reference_policy(policy, True, "bf16-mixed")
    assert isinstance(reference, FrozenCopy)
    shard_model(policy, mesh, precision="bf16-mixed")
    reference.shard(mesh)
    materialize(policy, source_dir(policy), "cpu")
    policy_reads = list(read)
    reference.place(torch.device("cpu"))
    model_dir._read_rows = original
    expected = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    _assert_same_model(policy, expected)
    _assert_same_model(
        reference.model, AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    )
    ref_dtypes = {p.dtype for p in reference.model.parameters()}
    ref_local = sum(p.to_local().numel() for p in reference.model.parameters())
    with torch.no_grad():  # "train" it: the saved policy must be the trainer's, not the start
        for param in policy.parameters():
            param.to_local().add_(0.01 * (rank + 1))
    trained = {n: p.full_tensor().to(torch.bfloat16) for n, p in policy.named_parameters()}
    saved = save_policy_shards(policy, out, dtype=torch.bfloat16, max_file_bytes=40_000)
    return {
        "reads": policy_reads,
        "numel": sum(p.numel() for p in policy.parameters()),
        "ref_dtypes": ref_dtypes,
        "ref_local": ref_local,
        "trained": trained if saved is not None else None,
        "saved": saved,
    }


def test_two_ranks_read_their_own_rows_hold_frozen_weights_in_bf16_and_write_it_back(
    dirs, tmp_path
):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_two_ranks, args=(port, dirs, tmp_path), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    for family in ("qwen2", "llama"):
        mine = [r[family] for r in ranks]
        numel = mine[0]["numel"]
        for rank in mine:  # each rank read about half of every tensor: its rows, never all
            rows = sum(_numel(lengths) for _, lengths in rank["reads"])
            assert 0.4 * numel < rows < 0.6 * numel, (family, rows, numel)
        read_rows = {}
        for rank in mine:
            for name, lengths in rank["reads"]:
                read_rows[name] = read_rows.get(name, 0) + lengths[0]
        # the two ranks' rows of each tensor add up to the tensor: nothing read twice
        expected = AutoModelForCausalLM.from_pretrained(dirs[family])
        shapes = {n: p.shape[0] for n, p in expected.named_parameters()}
        assert read_rows == shapes
        for rank in mine:  # the reference: bfloat16 shards, half the elements per rank
            assert rank["ref_dtypes"] == {torch.bfloat16}
            assert 0.4 * numel < rank["ref_local"] < 0.6 * numel
        saved = mine[0]["saved"]
        assert mine[1]["saved"] is None  # rank 0 writes
        files = sorted(p.name for p in saved.glob("*.safetensors"))
        assert len(files) > 1 and (saved / "model.safetensors.index.json").is_file()
        loaded = AutoModelForCausalLM.from_pretrained(saved)
        assert loaded.dtype == torch.bfloat16
        params = dict(loaded.named_parameters())
        assert set(params) == set(mine[0]["trained"])
        for name, tensor in mine[0]["trained"].items():
            assert torch.equal(params[name], tensor), (family, name)


def _numel(lengths: tuple[int, ...]) -> int:
    total = 1
    for size in lengths:
        total *= size
    return total


def _tiny_moe(family: str) -> torch.nn.Module:
    """A 2-layer, 4-expert mixture of experts of ``family`` (``qwen3_moe`` or ``mixtral``)."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    shape = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
    shape.update(num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64)
    torch.manual_seed(0)
    if family == "mixtral":
        return MixtralForCausalLM(MixtralConfig(**shape, num_local_experts=4))
    config = Qwen3MoeConfig(**shape, moe_intermediate_size=24, num_experts=4, head_dim=8)
    return Qwen3MoeForCausalLM(config)


def _saved_names(folder: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(next(folder.glob("*.safetensors"))), framework="pt") as f:
        return set(f.keys())


def _read(path: Path) -> torch.nn.Module:
    model = empty_model(path, torch.float32)
    materialize(model, path, "cpu")
    return model


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_fused_experts_are_read_from_a_checkpoints_per_expert_tensors(tmp_path, family):
    """transformers 5 fuses a sparse block's experts (``experts.gate_up_proj``, ``down_proj``)
    and saves them one tensor per expert (Qwen-MoE's ``experts.{e}.gate_proj``, Mixtral's
    ``block_sparse_moe.experts.{e}.w1``): the meta-device model read from such a directory
    holds every weight of the saved one, exactly."""
    model = _tiny_moe(family)
    model.save_pretrained(tmp_path)
    per_expert = {
        "mixtral": "model.layers.0.block_sparse_moe.experts.3.w1.weight",
        "qwen3_moe": "model.layers.0.mlp.experts.3.gate_proj.weight",
    }[family]
    assert per_expert in _saved_names(tmp_path)  # the checkpoint holds them one by one
    saved = model.state_dict()
    assert all(torch.equal(v, saved[k]) for k, v in _read(tmp_path).state_dict().items())


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_a_trained_mixture_of_experts_is_saved_as_its_checkpoints_are(tmp_path, family):
    """The trained policy of a mixture of experts is written one tensor per expert under the
    names ``save_pretrained`` gives them (which vLLM's loader reads too), and loads back with
    ``from_pretrained`` and with streamrl's sharded read to the same weights."""
    from streamrl.training.policy_save import save_policy_shards

    model = _tiny_moe(family)
    model.save_pretrained(tmp_path / "hf")
    save_policy_shards(model, tmp_path / "ours", dtype=torch.float32)
    assert _saved_names(tmp_path / "ours") == _saved_names(tmp_path / "hf")
    expected = model.state_dict()
    for loaded in (
        AutoModelForCausalLM.from_pretrained(tmp_path / "ours"),
        _read(tmp_path / "ours"),
    ):
        assert all(torch.equal(v, expected[k]) for k, v in loaded.state_dict().items())
