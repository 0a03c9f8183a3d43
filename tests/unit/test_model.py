"""Model layer: shapes, Hugging Face equivalence, deterministic (sharding-independent) init, checkpointing."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never touch the network, before transformers is imported

import multiprocessing as mp
import traceback
from pathlib import Path

import pytest
import torch

from zeroband.config import ModelConfig
from zeroband.models import (
    Llama,
    apply_activation_checkpointing,
    cross_entropy_loss,
    export_hf,
    flops_per_token,
    gather_full_state,
    hf_llama_config,
    load_full_state,
    load_hf_state,
    model_blocks,
    num_params,
)

transformers = pytest.importorskip("transformers")

# Small but with GQA, and odd vocab/ffn sizes so that 2-way FSDP shards are uneven.
SMALL = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=173, vocab_size=509, max_seq_len=64)
ATOL = 1e-5


def make(cfg: ModelConfig, seed: int = 0, std: float | None = None) -> Llama:
    model = Llama(cfg)
    model.init_weights(seed, std=std)
    return model.eval()


def randomize(model: torch.nn.Module, seed: int = 1) -> None:
    """Large, asymmetric weights (norms too) so attention is far from uniform and a swapped or
    mis-ordered tensor would change the logits, not vanish in the tolerance."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.2 * noise if "norm" in name else 0.08 * noise)


def tokens(cfg: ModelConfig, batch: int = 2, seq: int | None = None, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, seq or cfg.max_seq_len), generator=gen)


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return gather_full_state(model)


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# --------------------------------------------------------------------------------------------
# Shapes and sizes


@pytest.mark.parametrize(
    "cfg",
    [
        ModelConfig(preset="debug"),
        ModelConfig(preset="demo"),
        ModelConfig(**{**SMALL, "n_kv_heads": 4}),  # MHA
        ModelConfig(**{**SMALL, "n_kv_heads": 1}),  # MQA
        ModelConfig(**{**SMALL, "tie_embeddings": True}),
    ],
    ids=["debug", "demo", "mha", "mqa", "tied"],
)
def test_shapes_and_param_count(cfg: ModelConfig) -> None:
    model = make(cfg)
    x = tokens(cfg, seq=cfg.max_seq_len // 2)
    logits = model(x)
    assert logits.shape == (2, cfg.max_seq_len // 2, cfg.vocab_size)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    loss = cross_entropy_loss(logits, x)
    assert loss.ndim == 0 and loss.item() > 0
    assert num_params(cfg) == sum(p.numel() for p in model.parameters())
    embed = cfg.vocab_size * cfg.dim
    assert num_params(cfg, include_embedding=False) == num_params(cfg) - (0 if cfg.tie_embeddings else embed)
    n = num_params(cfg, include_embedding=False)
    assert flops_per_token(cfg, 128) == 6 * n + 12 * cfg.n_layers * cfg.dim * 128
    assert len(model_blocks(model)) == cfg.n_layers
    with pytest.raises(ValueError, match="max_seq_len"):
        model(tokens(cfg, seq=cfg.max_seq_len + 1))


def test_state_dict_keys_match_hf() -> None:
    cfg = ModelConfig(**SMALL)
    ours = {
        ("model." + k if k != "lm_head.weight" else k): v.shape for k, v in Llama(cfg).state_dict().items()
    }
    hf = transformers.LlamaForCausalLM(hf_llama_config(cfg, 0, 0))
    assert ours == {k: v.shape for k, v in hf.state_dict().items()}


def test_loss_matches_reference() -> None:
    logits = torch.randn(2, 5, 11)
    targets = torch.randint(0, 11, (2, 5))
    expected = torch.nn.functional.cross_entropy(logits.view(-1, 11), targets.view(-1))
    torch.testing.assert_close(cross_entropy_loss(logits, targets), expected)
    assert cross_entropy_loss(logits.bfloat16(), targets).dtype == torch.float32


# --------------------------------------------------------------------------------------------
# Hugging Face equivalence


def hf_model(path: Path, attn: str) -> torch.nn.Module:
    return transformers.LlamaForCausalLM.from_pretrained(
        path, attn_implementation=attn, dtype=torch.float32
    ).eval()


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_export_matches_transformers(tmp_path: Path, tie: bool) -> None:
    cfg = ModelConfig(**{**SMALL, "tie_embeddings": tie, "rope_theta": 5000.0, "norm_eps": 1e-6})
    model = make(cfg)
    randomize(model)
    export_hf(state(model), cfg, tmp_path / "hf", bos_id=1, eos_id=2)
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    assert not list(tmp_path.glob(".hf.tmp-*"))
    x = tokens(cfg)
    with torch.no_grad():
        ours = model(x)
        for attn in ("eager", "sdpa"):
            theirs = hf_model(tmp_path / "hf", attn)
            assert theirs.config.tie_word_embeddings is tie
            assert (ours - theirs(x).logits).abs().max().item() <= ATOL, attn
    assert ours.abs().max() > 1.0  # the comparison was not between near-zero logits


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_load_from_transformers(tmp_path: Path, tie: bool) -> None:
    cfg = ModelConfig(**{**SMALL, "tie_embeddings": tie})
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_llama_config(cfg, 0, 0)).eval()
    randomize(hf)
    hf.save_pretrained(tmp_path)
    model = Llama(cfg).eval()
    load_full_state(model, load_hf_state(tmp_path, cfg))
    x = tokens(cfg)
    with torch.no_grad():
        assert (model(x) - hf(x).logits).abs().max().item() <= ATOL


def test_tied_checkpoint_into_untied_model(tmp_path: Path) -> None:
    tied = ModelConfig(**{**SMALL, "tie_embeddings": True})
    export_hf(state(make(tied)), tied, tmp_path)
    untied = ModelConfig(**SMALL)
    loaded = load_hf_state(tmp_path, untied)
    assert torch.equal(loaded["lm_head.weight"], loaded["embed_tokens.weight"])


def test_sharded_safetensors_index(tmp_path: Path) -> None:
    cfg = ModelConfig(**SMALL)
    hf = transformers.LlamaForCausalLM(hf_llama_config(cfg, 0, 0))
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    loaded = load_hf_state(tmp_path, cfg)
    for k, v in hf.state_dict().items():
        assert torch.equal(loaded[k.removeprefix("model.")], v), k


def test_export_overwrites_atomically(tmp_path: Path) -> None:
    cfg = ModelConfig(**SMALL)

    class Tok:
        def save_pretrained(self, d: str | os.PathLike) -> None:
            (Path(d) / "tokenizer.json").write_text("{}")

    export_hf(state(make(cfg, seed=0)), cfg, tmp_path / "out")
    export_hf(state(make(cfg, seed=1)), cfg, tmp_path / "out", tokenizer=Tok())
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp or old dirs left behind
    assert_bitwise_equal(load_hf_state(tmp_path / "out", cfg), state(make(cfg, seed=1)))


def test_load_hf_config_mismatch_names_fields(tmp_path: Path) -> None:
    cfg = ModelConfig(**SMALL)
    export_hf(state(make(cfg)), cfg, tmp_path)
    with pytest.raises(ValueError, match=r"hidden_size 64 in checkpoint vs model.dim 128") as err:
        load_hf_state(tmp_path, ModelConfig(**{**SMALL, "dim": 128}))
    assert "intermediate_size" not in str(err.value)  # only what differs is listed
    with pytest.raises(
        ValueError, match=r"num_key_value_heads 2 in checkpoint vs model.n_kv_heads 4; rope_theta"
    ):
        load_hf_state(tmp_path, ModelConfig(**{**SMALL, "n_kv_heads": 4, "rope_theta": 1e6}))


def test_load_full_state_shape_mismatch() -> None:
    cfg = ModelConfig(**SMALL)
    full = state(make(cfg))
    full["layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"layers.1.mlp.up_proj.weight.*\(173, 64\).*\(3, 3\)"):
        load_full_state(Llama(cfg), full)
    del full["layers.1.mlp.up_proj.weight"]
    with pytest.raises(KeyError, match="up_proj"):
        load_full_state(Llama(cfg), full)


# --------------------------------------------------------------------------------------------
# Deterministic initialisation


def test_init_deterministic() -> None:
    cfg = ModelConfig(**SMALL)
    a, b, c = state(make(cfg, seed=3)), state(make(cfg, seed=3)), state(make(cfg, seed=4))
    assert_bitwise_equal(a, b)
    for k in a:
        if "norm" in k:
            assert torch.equal(a[k], torch.ones_like(a[k]))
        else:
            assert not torch.equal(a[k], c[k]), k
    # Residual out-projections start smaller (GPT-2 scaling).
    assert a["layers.0.self_attn.o_proj.weight"].std() < 0.6 * a["layers.0.self_attn.q_proj.weight"].std()
    # Each tensor is drawn independently: no two weights of equal shape coincide.
    assert not torch.equal(a["layers.0.mlp.gate_proj.weight"], a["layers.0.mlp.up_proj.weight"])


def test_meta_init_equals_cpu_init() -> None:
    cfg = ModelConfig(**SMALL)
    with torch.device("meta"):
        model = Llama(cfg)
    assert model.rope_cos.is_meta
    model.to_empty(device="cpu")
    model.init_weights(7)
    direct = make(cfg, seed=7)
    assert_bitwise_equal(state(model), state(direct))
    assert torch.equal(model.rope_cos, direct.rope_cos) and torch.equal(model.rope_sin, direct.rope_sin)
    x = tokens(cfg)
    with torch.no_grad():
        assert torch.equal(model.eval()(x), direct(x))


# --------------------------------------------------------------------------------------------
# Activation checkpointing


def loss_and_grads(model: Llama, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = cross_entropy_loss(model(x[:, :-1]), x[:, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_activation_checkpointing_same_keys_loss_grads() -> None:
    cfg = ModelConfig(**SMALL)
    plain, ckpt = make(cfg).train(), make(cfg).train()
    apply_activation_checkpointing(ckpt)
    assert list(ckpt.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in ckpt.named_parameters()] == [n for n, _ in plain.named_parameters()]
    x = tokens(cfg)
    loss_a, grads_a = loss_and_grads(plain, x)
    loss_b, grads_b = loss_and_grads(ckpt, x)
    assert torch.equal(loss_a, loss_b)
    for k in grads_a:
        torch.testing.assert_close(grads_a[k], grads_b[k], rtol=0, atol=1e-7, msg=k)


# --------------------------------------------------------------------------------------------
# FSDP2: sharded init == unsharded init (2 CPU processes, gloo)


def _fsdp_worker(rank: int, world: int, store_path: str, out_dir: str, seed: int, queue: mp.Queue) -> None:
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
        cfg = ModelConfig(**SMALL)
        with torch.device("meta"):
            model = Llama(cfg)
        apply_activation_checkpointing(model)
        for block in model_blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        model.init_weights(seed)
        full = gather_full_state(model)
        local_rows = {n: p.to_local().shape[0] for n, p in model.named_parameters()}
        # Same batch on both ranks: FSDP's averaged gradients then equal single-process gradients.
        loss = cross_entropy_loss(model(tokens(cfg)[:, :-1]), tokens(cfg)[:, 1:])
        loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        # Round trip: load_full_state into the sharded model reproduces the same shards.
        before = {n: p.to_local().clone() for n, p in model.named_parameters()}
        load_full_state(model, full)
        reloaded = all(torch.equal(before[n], p.to_local()) for n, p in model.named_parameters())
        torch.save(
            dict(full=full, grads=grads, loss=loss.detach(), rows=local_rows, reloaded=reloaded),
            Path(out_dir) / f"rank{rank}.pt",
        )
        dist.destroy_process_group()
        queue.put((rank, None))
    except BaseException:
        queue.put((rank, traceback.format_exc()))


@pytest.mark.timeout(60)
def test_fsdp_sharded_init_equals_unsharded(tmp_path: Path) -> None:
    world, seed = 2, 11
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_fsdp_worker, args=(r, world, str(tmp_path / "store"), str(tmp_path), seed, queue))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        errors = [queue.get(timeout=45) for _ in range(world)]
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    failed = [f"rank {r}:\n{tb}" for r, tb in errors if tb]
    assert not failed, "\n".join(failed)

    cfg = ModelConfig(**SMALL)
    ref = make(cfg, seed=seed).train()
    ref_loss, ref_grads = loss_and_grads(ref, tokens(cfg))
    for r in range(world):
        out = torch.load(tmp_path / f"rank{r}.pt")
        assert_bitwise_equal(out["full"], state(ref))
        assert out["reloaded"]
        torch.testing.assert_close(out["loss"], ref_loss, rtol=0, atol=1e-6)
        for k in ref_grads:
            torch.testing.assert_close(out["grads"][k], ref_grads[k], rtol=1e-5, atol=1e-6, msg=k)
    # The odd vocab really was split unevenly (255 + 254 rows).
    rows = [torch.load(tmp_path / f"rank{r}.pt")["rows"]["embed_tokens.weight"] for r in range(world)]
    assert rows == [255, 254]
