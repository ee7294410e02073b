"""``q38 rl``: from a Hugging Face directory (byte tokenizer), a prompts file and built-in rewards, progress lines
per iteration and a checkpoint; a second call resumes at the next iteration and gives the state a single longer run
gives; bad input is one line (exit 2)."""

import pytest
import torch

import q38
from q38.cli import main
from q38.pytree import named_leaves
from tests.test_generate import CFG as _GEN_CFG

# test_generate's model (unlike tiny; vocab 300 holds the byte tokenizer's 261) with expert widths whose rows are a
# multiple of 16 bytes (the grouped matmul the training forward resolves to refuses others: 18 x 4 bytes fails).
CFG = _GEN_CFG.replace(moe_intermediate_size=20, shared_expert_intermediate_size=24)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("rl") / "hf"
    q38.save_hf(d, CFG, q38.init_params(CFG, seed=13))
    return d


def _prompts(tmp_path):
    f = tmp_path / "prompts.jsonl"
    f.write_text('{"prompt": "1+2=", "answer": 3}\n{"prompt": "2+2=", "answer": 4}\n{"prompt": "5-1=", "answer": 4}\n')
    return f


def _args(hf_dir, prompts, out, iterations):
    return ["rl", str(hf_dir), "--prompts", str(prompts), "--out", str(out), "--reward", "numeric_answer",
            "--reward", "tests.test_rl:user_reward", "--iterations", str(iterations), "--prompts-per-iteration", "2",
            "--group-size", "2", "--max-new-tokens", "3", "--set", "train.lr=1e-3"]


@pytest.mark.slow
def test_q38_rl_runs_checkpoints_and_resumes_exactly(hf_dir, tmp_path, capsys):
    from q38.train.core.state import init_state
    from q38.train.core.step_config import TrainConfig
    from q38.train.io.checkpoint import latest_checkpoint, load_checkpoint, read_meta

    prompts = _prompts(tmp_path)
    assert main(_args(hf_dir, prompts, tmp_path / "a", 2)) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("iter ")]
    assert [ln.split()[1] for ln in lines] == ["0", "1"] and all("mismatch max" in ln for ln in lines)
    assert main(_args(hf_dir, prompts, tmp_path / "b", 1)) == 0
    assert main(_args(hf_dir, prompts, tmp_path / "b", 1)) == 0
    out = capsys.readouterr().out
    assert "resuming" in out and [ln.split()[1] for ln in out.splitlines() if ln.startswith("iter ")] == ["0", "1"]
    a, b = latest_checkpoint(tmp_path / "a" / "checkpoints"), latest_checkpoint(tmp_path / "b" / "checkpoints")
    assert read_meta(a)["rl"]["next_iteration"] == read_meta(b)["rl"]["next_iteration"] == 2
    template = init_state(CFG, TrainConfig(), seed=0)
    sa, _ = load_checkpoint(a, template)
    sb, _ = load_checkpoint(b, template)
    assert int(sa.step) == 2
    for (n, x), (_, y) in zip(named_leaves(sa.params), named_leaves(sb.params)):
        assert torch.equal(x, y), n


def test_q38_rl_bad_input_is_one_line(hf_dir, tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "1+2="}\n')
    assert main(_args(hf_dir, f, tmp_path / "c", 1)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no `answer`" in err
    args = _args(hf_dir, _prompts(tmp_path), tmp_path / "d", 1)
    args[args.index("--group-size") + 1] = "1"
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "group of one" in err


@pytest.mark.parametrize("where", ["the source", "inside the source", "a second name of the source"])
def test_q38_rl_refuses_an_out_that_is_its_source(hf_dir, tmp_path, capsys, where):
    """``--out`` the source directory (or inside it, or a symlink to it) would put the RL checkpoints among the
    source's own: one line, nothing written."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(hf_dir, src)
    before = sorted(p.name for p in src.rglob("*"))
    link = tmp_path / "link"
    link.symlink_to(src)
    out = {"the source": src, "inside the source": src / "rl", "a second name of the source": link}[where]
    assert main(_args(src, _prompts(tmp_path), out, 1)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "run.out_dir" in err and "source" in err, err
    assert sorted(p.name for p in src.rglob("*")) == before


PP_LAYOUT = "{include: fsdp.yaml, name: pp_only, mesh: {pp: 2, fsdp: 1}}\n"


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp", "pp"])
def test_q38_rl_under_torchrun_equals_one_process(tmp_path, capsys, layout):
    """``torchrun --nproc_per_node 2 … rl --set layout=fsdp``: the state sharded over 2 gloo ranks, each rank
    decoding its share of the prompts; progress lines from rank 0 only; the checkpoint it writes (on every rank)
    holds the parameters 2 iterations on one process give (fp32, 1e-5). 6 experts (FSDP shards them over 2 ranks),
    top-3 routing. ``pp``: 2 pipeline stages (each decoding every prompt, its own layers; 2 micro-batches, the one
    process too)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from q38.train.core.state import init_state
    from q38.train.core.step_config import TrainConfig
    from q38.train.io.checkpoint import latest_checkpoint, load_checkpoint

    cfg = CFG.replace(num_experts=6, num_experts_per_tok=3)
    hf_dir = tmp_path / "hf"
    q38.save_hf(hf_dir, cfg, q38.init_params(cfg, seed=13))
    prompts = _prompts(tmp_path)
    extra = ["--set", "train.micro_batches=2"] if layout == "pp" else []
    if layout == "pp":
        (tmp_path / "pp.yaml").write_text(PP_LAYOUT)
    assert main(_args(hf_dir, prompts, tmp_path / "one", 2) + extra) == 0
    capsys.readouterr()
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    repo = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join([str(repo), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "q38.cli",
           *_args(hf_dir, prompts, tmp_path / "two", 2), *extra, "--set",
           f"layout={tmp_path / 'pp.yaml' if layout == 'pp' else 'fsdp'}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=repo, env=env, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if layout == "pp":  # each stage wrote only its own layers (0-1 on rank 0, 2-3 on rank 1): the pipeline ran
        from torch.distributed.checkpoint import FileSystemReader

        md = FileSystemReader(latest_checkpoint(tmp_path / "two" / "checkpoints")).read_metadata()
        files: dict = {}
        for k, v in md.storage_data.items():
            files.setdefault(k.fqn, set()).add(v.relative_path)
        assert files["params.layers.0.attn_norm"] == {"__0_0.distcp"}, files["params.layers.0.attn_norm"]
        assert files["params.layers.3.attn_norm"] == {"__1_0.distcp"}, files["params.layers.3.attn_norm"]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("iter ")]
    assert [ln.split()[1] for ln in lines] == ["0", "1"], proc.stdout
    template = init_state(cfg, TrainConfig(), seed=0)
    one, _ = load_checkpoint(latest_checkpoint(tmp_path / "one" / "checkpoints"), template)
    two, _ = load_checkpoint(latest_checkpoint(tmp_path / "two" / "checkpoints"), template)
    assert int(two.step) == 2
    for (n, x), (_, y) in zip(named_leaves(one.params), named_leaves(two.params)):
        assert float((x - y).abs().max()) <= 1e-5, n


def test_chat_prompts_go_through_the_chat_template(tmp_path):
    """A chat line (``messages``) is rendered as ChatML with the assistant turn opened, the text written out here by
    hand; the reward functions get that rendered text; a line with both keys or a bad chat is one line."""
    from q38.errors import DataError
    from q38.train.data.tokenizer import load_tokenizer
    from q38.train.run.rl import encode_prompts, load_prompts

    f = tmp_path / "chat.jsonl"
    f.write_text('{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2="}], '
                 '"answer": 3}\n{"prompt": "2+2=", "answer": 4}\n')
    records = load_prompts(f, ["numeric_answer"])
    tok = load_tokenizer("byte")
    records, ids = encode_prompts(records, tok, str(f))
    chatml = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"
    assert records[0].prompt == chatml and tok.decode(ids[0]) == chatml and records[0].answer == "3"
    assert ids[1] == list(tok.encode("2+2=")) and records[1].prompt == "2+2="
    for line, msg in [('{"prompt": "x", "messages": [{"role": "user", "content": "x"}]}', "both `prompt` and"),
                      ('{"messages": []}', "non-empty list"),
                      ('{"messages": [{"role": "wizard", "content": "x"}]}', r"messages\[0\].role is 'wizard'")]:
        f.write_text(line + "\n")
        with pytest.raises(DataError, match=msg) as e:
            load_prompts(f)
        assert "line 1" in str(e.value) and len(str(e.value).splitlines()) == 1


@pytest.mark.slow
def test_q38_rl_takes_chat_prompts(hf_dir, tmp_path, capsys):
    f = tmp_path / "chat.jsonl"
    f.write_text("".join('{"messages": [{"role": "user", "content": "%s"}], "answer": %d}\n' % (q, a)
                         for q, a in [("1+2=", 3), ("2+2=", 4), ("5-1=", 4)]))
    assert main(_args(hf_dir, f, tmp_path / "chat_out", 1)) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("iter ")]
    assert len(lines) == 1 and "mismatch max" in lines[0]
