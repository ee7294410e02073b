"""Every bad input an operator can give ends the same way: exit code 2, exactly one line on stderr, no traceback,
and the line names the offending key or file (issue 11).

The cases run in-process through ``q38.cli.main`` with captured stderr (fast); a handful also run as real
subprocesses (``python -m q38.cli``) to check the process-level behaviour is the same.
"""

import fcntl
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from q38.cli import main
from tests.run_utils import q38, run_dict, write_config


class Ctx:
    """Per-case helpers: ``cfg(**sections)`` writes a run config (out_dir ``tmp/out``); ``run()`` copies a finished
    two-checkpoint run there; ``data(text)`` writes a data file."""

    def __init__(self, tmp: Path, good_run: Path):
        self.tmp, self.good_run, self.out = tmp, good_run, tmp / "out"

    def cfg(self, name="run.yaml", **sections) -> str:
        return str(write_config(self.tmp / name, run_dict(self.out, steps=2, **sections)))

    def run(self) -> Path:
        shutil.copytree(self.good_run, self.out)
        return self.out

    def ck(self, step: int) -> Path:
        return self.out / "checkpoints" / f"step_{step:06d}"

    def data(self, text: str, name="data.jsonl") -> str:
        p = self.tmp / name
        p.write_text(text)
        return str(p)

    def hf(self) -> Path:
        """A tiny Hugging Face checkpoint exported from the good run."""
        d = self.tmp / "hf"
        assert main(["convert", "--to-hf", str(self.good_run), str(d)]) == 0
        return d

    def dir(self, name: str, *files: str) -> Path:
        """A directory ``tmp/name`` holding the (empty) ``files``."""
        d = self.tmp / name
        d.mkdir(parents=True, exist_ok=True)
        for f in files:
            (d / f).write_text("")
        return d

    def shards(self, name="shards") -> Path:
        """A prepared directory of one text record (one shard)."""
        d = self.tmp / name
        assert main(["prepare-data", self.data(json.dumps({"text": "a prepared document " * 8}) + "\n", "p.jsonl"),
                     "--out", str(d), "--no-progress"]) == 0
        return d


@pytest.fixture(scope="module")
def good_run(tmp_path_factory):
    """A finished 2-step run with checkpoints at steps 1 and 2 (copied by the cases that need one)."""
    root = tmp_path_factory.mktemp("good")
    cfg = write_config(root / "run.yaml", run_dict(root / "run", steps=2, run={"save_every": 1}))
    assert main(["train", str(cfg)]) == 0
    return root / "run"


# ---- the cases: id -> ctx -> (argv, needles the one line must contain) -----------------------------------------------

SET_CASES = [  # --set KEY=VALUE on a valid config: the line names KEY (typed config: type and range)
    ("train.lr=abc", "train.lr must be a number, got 'abc'"),
    ("train.lr=-1", "train.lr must be > 0, got -1"),
    ("train.lr=0", "train.lr must be > 0"),
    ("train.lr=.nan", "train.lr must be > 0, got nan"),
    ("train.lr=.inf", "train.lr must be a finite number"),
    ("train.lr=true", "train.lr must be a number, got True"),
    ("train.beta1=2", "train.beta1 must be in [0, 1), got 2"),
    ("train.beta1=-0.1", "train.beta1 must be in [0, 1)"),
    ("train.beta1=1", "train.beta1 must be in [0, 1), got 1"),
    ("train.beta2=1.5", "train.beta2 must be in [0, 1)"),
    ("train.beta2=x", "train.beta2 must be a number"),
    ("train.eps=tiny", "train.eps must be a number, got 'tiny'"),
    ("train.eps=0", "train.eps must be > 0"),
    ("train.weight_decay=x", "train.weight_decay must be a number"),
    ("train.weight_decay=-1", "train.weight_decay must be >= 0"),
    ("train.total_steps=ten", "train.total_steps must be an integer, got 'ten'"),
    ("train.total_steps=0", "train.total_steps must be > 0"),
    ("train.total_steps=1.5", "train.total_steps must be an integer, got 1.5"),
    ("train.warmup_steps=1.5", "train.warmup_steps must be an integer, got 1.5"),
    ("train.warmup_steps=-1", "train.warmup_steps must be >= 0"),
    ("train.warmup_steps=100", "train.warmup_steps (100) must be between 0 and total_steps"),
    ("train.schedule=exp", "train.schedule must be one of cosine, linear, constant, got 'exp'"),
    ("train.schedule=1", "train.schedule must be a string"),
    ("train.min_lr_ratio=2", "train.min_lr_ratio must be in [0, 1]"),
    ("train.grad_clip=0", "train.grad_clip must be > 0"),
    ("train.grad_clip=abc", "train.grad_clip must be a number or null"),
    ("train.micro_batches=0", "train.micro_batches must be >= 1"),
    ("train.micro_batches=two", "train.micro_batches must be an integer"),
    ("train.loss_chunk_size=0", "train.loss_chunk_size must be > 0"),
    ("train.loss_chunk_size=x", "train.loss_chunk_size must be an integer or null"),
    ("train.dynamic_chunk_loss=maybe", "train.dynamic_chunk_loss must be true or false, got 'maybe'"),
    ("train.dynamic_chunk_loss=true", "train.dynamic_chunk_loss: true needs loss_chunk_budget_bytes"),
    ("train.loss_chunk_budget_bytes=-5", "train.loss_chunk_budget_bytes must be > 0"),
    ("train.mtp_loss_scaling_factor=-1", "train.mtp_loss_scaling_factor must be >= 0"),
    ("train.aux_loss_coef=-1", "train.aux_loss_coef must be >= 0"),
    ("train.aux_loss_scope=sequence", "train.aux_loss_scope must be one of"),
    ("train.recompute=yes please", "train.recompute must be true or false, got 'yes please'"),
    ("train.recompute=2", "train.recompute must be true or false, got 2"),
    ("train.skip_gdn_recompute=true", "train.skip_gdn_recompute: true needs recompute: true"),
    ("train.nan_policy=ignore", "train.nan_policy must be one of stop, skip"),
    ("train.max_dup_experts_num=-1", "train.max_dup_experts_num must be >= 0"),
    ("train.ep_dispatch=ring", "train.ep_dispatch must be one of flat, hierarchical, got 'ring'"),
    ("train.ep_overlap=maybe", "train.ep_overlap must be true or false, got 'maybe'"),
    ("train.no_decay=abc", "train.no_decay must be a list of strings, got 'abc'"),
    ("train.no_decay=[1, 2]", "train.no_decay must be a list of strings"),
    ("train.offload_activations=x", "train.offload_activations must be true or false"),
    ("train.enable_ep_balance=true", "enable_ep_balance: true needs expert parallelism"),
    ("train.fsdp_prefetch=sometimes", "train.fsdp_prefetch must be true or false or null"),
    ("train.lrr=0.1", "unknown train config key(s): 'lrr' (did you mean 'lr'?)"),
    ("run.steps=0", "run.steps must be a positive integer, got 0"),
    ("run.steps=ten", "run.steps must be an integer, got 'ten'"),
    ("run.steps=1.5", "run.steps must be an integer, got 1.5"),
    ("run.seed=x", "run.seed must be an integer"),
    ("run.log_every=0", "run.log_every must be a positive integer"),
    ("run.save_every=-1", "run.save_every must be an integer >= 0"),
    ("run.keep_last=-1", "run.keep_last must be an integer >= 0"),
    ("run.device=tpu", "run.device must be one of auto, cpu, cuda, npu"),
    ("run.backend=mpi", "run.backend must be one of"),
    ("run.dtype=float64", "train.param_dtype must be one of ('float32', 'bfloat16'), got 'float64'"),  # run.dtype: alias
    ("run.progress=yes please", "run.progress must be true or false, got 'yes please'"),
    ("run.tensorboard=maybe", "run.tensorboard must be true or false"),
    ("run.resume=2", "run.resume must be true or false, got 2"),
    ("run.peak_flops=-1", "run.peak_flops must be a positive number"),
    ("run.peak_flops=fast", "run.peak_flops must be a number or null, got 'fast'"),
    ("run.out_dir=", "run.out_dir must be a string, got None"),
    ("run.out_dir=' '", "run.out_dir must be a non-empty path"),
    ("run.warmup_log_steps=-1", "run.warmup_log_steps must be an integer >= 0"),
    ("run.resume_from=3", "run.resume_from must be a string or null, got 3"),
    ("run.stpes=5", "unknown key(s) in section 'run': 'stpes' (did you mean 'steps'?)"),
    ("data.seq_len=0", "data.seq_len must be a positive integer"),
    ("data.seq_len=x", "data.seq_len must be an integer, got 'x'"),
    ("data.batch_size=0", "data.batch_size must be a positive integer"),
    ("data.batch_size=1.5", "data.batch_size must be an integer, got 1.5"),
    ("data.overlong=drop", "data.overlong must be one of"),
    ("data.shuffle=maybe", "data.shuffle must be true or false, got 'maybe'"),
    ("data.tokenizer=5", "data.tokenizer must be a string, got 5"),
    ("data.path=5", "data.path must be a string"),
    ("data.seq_lenn=8", "(did you mean 'seq_len'?)"),
    ("model.hidden_size=x", "model.hidden_size must be an integer, got 'x'"),
    ("model.num_hidden_layers=0", "model.num_hidden_layers must be a positive integer"),
    ("model.partial_rotary_factor=2", "model.partial_rotary_factor must be in (0, 1]"),
    ("model.hidden_act=gelu", "model.hidden_act 'gelu' is not supported"),
    ("model.layer_types=[1, 2]", "model.layer_types must be a list of strings or null"),
    ("model.rms_norm_eps=0", "model.rms_norm_eps must be > 0"),
    ("model.norm_topk_prob=perhaps", "model.norm_topk_prob must be true or false"),
    ("model.gdn_implementation=cuda", "kernels.gdn must be one of"),  # a legacy model key, read as a kernel setting
    ("model.frobs=1", "unknown model config key(s): 'frobs'"),
    ("trian={}", "unknown top-level key 'trian' (did you mean 'train'?)"),
    ("train=5", "section 'train' must be a mapping"),
    ("layout=nope", "nope"),
    ("layout=fsdp_ep", "layout 'fsdp_ep'"),
    ("model=nosuchpreset", "unknown model preset 'nosuchpreset'"),
]


def _set_case(kv, needle):
    return lambda c: (["train", c.cfg(), "--set", kv], [needle])


def _cases():
    C = {}
    for kv, needle in SET_CASES:
        C[f"set:{kv}"] = _set_case(kv, needle)

    # --set syntax and the train subcommand's own arguments
    C["set:no-equals"] = lambda c: (["train", c.cfg(), "--set", "runsteps"], ["--set expects SECTION.KEY=VALUE"])
    C["set:empty-key"] = lambda c: (["train", c.cfg(), "--set", "=3"], ["--set expects SECTION.KEY=VALUE"])
    C["set:missing-value"] = lambda c: (["train", c.cfg(), "--set"], ["argument --set: expected one argument"])
    C["train:unknown-flag"] = lambda c: (["train", c.cfg(), "--bogus"], ["unrecognized arguments: --bogus"])
    C["train:two-configs"] = lambda c: (["train", c.cfg(), c.cfg("b.yaml")], ["unrecognized arguments"])

    # config files
    C["config:missing"] = lambda c: (["train", str(c.tmp / "nope.yaml")], ["train config not found", "nope.yaml"])
    C["config:not-yaml"] = lambda c: (["train", c.data("a: [1,\n", "bad.yaml")], ["bad.yaml: not valid YAML"])
    C["config:a-list"] = lambda c: (["train", c.data("- 1\n- 2\n", "list.yaml")], ["list.yaml: expected a mapping"])
    C["config:no-model"] = lambda c: (["train", c.cfg(model=None)], ["the 'model' key is required"])
    C["config:model-yaml-missing"] = lambda c: (["train", c.cfg(model=str(c.tmp / "m.yaml"))],
                                                ["model config file not found", "m.yaml"])
    C["config:model-dir-without-config"] = lambda c: ((c.tmp / "empty").mkdir() or
                                                      ["train", c.cfg(model=str(c.tmp / "empty"))],
                                                      ["empty is a directory without config.json"])
    C["config:model-json-not-json"] = lambda c: (["train", c.cfg(model=c.data("{oops", "config.json"))],
                                                 ["config.json is not valid JSON"])
    C["config:data-section-list"] = lambda c: (["train", c.cfg(data=[1, 2])], ["section 'data' must be a mapping"])

    # malformed model / layout / run config files (issue 35): one line naming the file and the problem, never
    # "internal error"
    def model_yaml(text, *needles, name="m.yaml"):
        return lambda c: (["train", c.cfg(model=c.data(text, name))], [name, *needles])

    def layout_yaml(text, *needles, name="l.yaml"):
        return lambda c: (["train", c.cfg(layout=c.data(text, name))], [name, *needles])

    C["config:model-yaml-syntax"] = model_yaml("hidden_size: [1,\n", "not valid YAML", "line 2, column 1")
    C["config:model-yaml-empty"] = model_yaml("", "model config", "is empty")
    C["config:model-yaml-list"] = model_yaml("- 1\n- 2\n", "expected a mapping of config keys, got list")
    C["config:model-yaml-duplicate-key"] = model_yaml("hidden_size: 8\nhidden_size: 9\n",
                                                      "key 'hidden_size' appears twice at line 2")
    C["config:model-yaml-int-key"] = model_yaml("1: 2\n", "1 (keys must be names)")
    C["config:model-yaml-null-key"] = model_yaml("null: 2\n", "None (keys must be names)")
    C["config:model-yaml-list-key"] = model_yaml("? [1, 2]\n: 3\n", "found unhashable key")
    C["config:model-yaml-tab"] = model_yaml("a:\n\tb: 1\n", "not valid YAML", "line 2")
    C["config:model-yaml-not-utf8"] = lambda c: (["train", c.cfg(model=str(c.tmp / "b.yaml"))],
                                                 ["b.yaml", "not valid YAML"]) if (c.tmp / "b.yaml").write_bytes(
                                                     b"\xff\xfe\x00a: 1") else None
    C["config:model-yaml-nested-deep"] = model_yaml("a: " + "[" * 3000 + "]" * 3000 + "\n", "nested too deeply")
    C["config:layout-yaml-syntax"] = layout_yaml("mesh: {fsdp: [\n", "not valid YAML", "line 2")
    C["config:layout-yaml-empty"] = layout_yaml("", "is empty")
    C["config:layout-yaml-list"] = layout_yaml("- 1\n", "expected a mapping")
    C["config:layout-yaml-mesh-list"] = layout_yaml("mesh: [1, 2]\n", "'mesh' must be a mapping")
    C["config:run-yaml-int-key"] = lambda c: (["train", c.data("1: 2\n", "r.yaml")],
                                              ["r.yaml", "top-level key 1 is not a section name"])
    C["config:run-yaml-duplicate-section"] = lambda c: (["train", c.data("model: tiny\nmodel: tiny\n", "r.yaml")],
                                                        ["r.yaml", "key 'model' appears twice"])
    C["config:kernels-section-list"] = lambda c: (["train", c.cfg(kernels=[1])],
                                                 ["section 'kernels' must be a mapping"])
    C["plan:train-kernels-list"] = lambda c: (["plan", "--model", "tiny", "--layout", "single", "--world", "1",
                                               "--train", c.data("kernels: [1]\n", "t.yaml")],
                                              ["'kernels' must be a mapping"])

    def hf_config(text, *needles):
        def case(c):
            d = c.tmp / "hfc"
            d.mkdir()
            (d / "config.json").write_text(text)
            return ["init-hf", "--model", str(d / "config.json"), str(c.tmp / "o")], [str(d / "config.json"), *needles]
        return case

    C["init:hf-config-missing-key"] = hf_config('{"model_type": "qwen3_5_moe_text"}',
                                                "required key 'num_hidden_layers' is missing")
    C["init:hf-config-text-config-list"] = hf_config('{"model_type": "qwen3_5_moe", "text_config": [1]}',
                                                     "wrong type or form")
    C["prepare:jsonl-nested-deep"] = lambda c: (["prepare-data", c.data("[" * 100000 + "]" * 100000 + "\n", "d.jsonl"),
                                                 "--out", str(c.tmp / "o"), "--no-progress", "--workers", "1"],
                                                ["d.jsonl:1", "nested too deeply"])
    C["prepare:line-over-the-limit"] = lambda c: (
        ["prepare-data", c.data('{"text": "a"}\n' + '{"text": "' + "x" * 3000 + '"}\n', "long.jsonl"), "--out",
         str(c.tmp / "o"), "--no-progress", "--workers", "1", "--max-line-mb", "0.001"],
        ["long.jsonl:2", "line longer than 1,048 bytes", "--max-line-mb"])

    # data
    C["data:missing"] = lambda c: (["train", c.cfg(data={"path": str(c.tmp / "missing.jsonl")})],
                                   ["missing.jsonl not found"])
    C["data:empty"] = lambda c: (["train", c.cfg(data={"path": c.data("\n\n")})], ["data.jsonl contains no records"])
    C["data:malformed-line"] = lambda c: (["train", c.cfg(data={"path": c.data('{"text": "a"}\n{"text": "b\n')})],
                                          ["data.jsonl:2: malformed JSON"])
    C["data:no-text-key"] = lambda c: (["train", c.cfg(data={"path": c.data('{"body": "a"}\n')})],
                                       ["data.jsonl:1", "neither plain text nor chat"])
    C["data:text-not-string"] = lambda c: (["train", c.cfg(data={"path": c.data('{"text": 5}\n')})],
                                           ["data.jsonl:1", "\"text\" must be a string"])
    C["data:bad-role"] = lambda c: (["train", c.cfg(data={"path": c.data(
        '{"messages": [{"role": "bot", "content": "x"}]}\n')})], ["data.jsonl:1", "messages[0].role"])
    C["data:no-trainable-tokens"] = lambda c: (["train", c.cfg(data={"path": c.data(
        '{"messages": [{"role": "user", "content": "hi"}]}\n')})], ["data.jsonl has no trainable tokens"])
    C["data:overlong-error"] = lambda c: (["train", c.cfg(data={"path": c.data(json.dumps({"text": "w " * 40}) + "\n"),
                                                                "overlong": "error"})], ["data.jsonl:1"])
    C["data:tokenizer-missing"] = lambda c: (["train", c.cfg(data={"tokenizer": str(c.tmp / "tok")})], ["tok"])

    # checkpoints and resume
    def all_meta_missing(c):
        c.run()
        for s in (1, 2):
            os.remove(c.ck(s) / "meta.json")
        return ["train", c.cfg(run={"steps": 4})], ["none verifies", "meta.json is missing"]

    def all_truncated(c):
        c.run()
        for s in (1, 2):
            shard = next(c.ck(s).glob("*.distcp"))
            shard.write_bytes(shard.read_bytes()[:100])
        return ["train", c.cfg(run={"steps": 4})], ["none verifies", "is 100 bytes, the manifest says"]

    def resume_from(mutate, needle):
        def build(c):
            c.run()
            mutate(c.ck(2))
            return ["train", c.cfg(run={"steps": 4, "resume_from": str(c.ck(2))})], ["run.resume_from", needle]
        return build

    def trunc_shard(d):
        shard = next(d.glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:-1])

    C["ckpt:all-meta-missing"] = all_meta_missing
    C["ckpt:all-shards-truncated"] = all_truncated
    C["ckpt:resume_from-missing"] = lambda c: (["train", c.cfg(run={"resume_from": str(c.tmp / "gone")})],
                                               ["run.resume_from", "gone does not verify: does not exist"])
    C["ckpt:resume_from-truncated-shard"] = resume_from(trunc_shard, "bytes, the manifest says")
    C["ckpt:resume_from-zero-byte-shard"] = resume_from(lambda d: next(d.glob("*.distcp")).write_bytes(b""),
                                                        "is 0 bytes")
    C["ckpt:resume_from-no-manifest"] = resume_from(lambda d: os.remove(d / "manifest.json"), "no manifest.json")
    C["ckpt:resume_from-no-metadata"] = resume_from(lambda d: os.remove(d / ".metadata"), ".metadata is missing")
    C["ckpt:resume_from-altered-meta"] = resume_from(
        lambda d: (d / "meta.json").write_text((d / "meta.json").read_text().replace('"step": 2', '"step": 9')),
        "meta.json")
    C["ckpt:resume_from-bad-manifest"] = resume_from(lambda d: (d / "manifest.json").write_text("{"),
                                                     "manifest.json is unreadable")
    C["ckpt:resume-false-with-checkpoints"] = lambda c: (c.run() and ["train", c.cfg(run={"resume": False})],
                                                         ["already holds checkpoints", "run.resume is false"])
    C["ckpt:another-model"] = lambda c: (c.run() and ["train", c.cfg(run={"steps": 4}, model="tiny")],
                                         ["was made for another model config"])
    C["metrics:malformed-middle-line"] = lambda c: (
        c.run() and (c.out / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n') and
        ["train", c.cfg(run={"steps": 4})], ["metrics.jsonl:2: malformed metrics record"])
    C["metrics:non-object-line"] = lambda c: (
        c.run() and (c.out / "metrics.jsonl").write_text('{"step": 1}\n[1, 2]\n{"step": 2}\n') and
        ["train", c.cfg(run={"steps": 4})], ["metrics.jsonl:2:", "not a JSON object"])

    # init_from
    def init_truncated(c):
        hf = c.hf()
        f = hf / "model.safetensors"
        f.write_bytes(f.read_bytes()[:-64])
        return ["train", c.cfg(init_from=str(hf))], ["model.safetensors is truncated"]

    def init_bad_json(c):
        hf = c.hf()
        (hf / "config.json").write_text("{not json")
        return ["train", c.cfg(init_from=str(hf), model=None)], ["config.json is not valid JSON"]

    def init_garbage(c):
        hf = c.hf()
        (hf / "model.safetensors").write_bytes(b"\x00" * 4)
        return ["train", c.cfg(init_from=str(hf))], ["model.safetensors is not a readable safetensors file"]

    C["init_from:missing"] = lambda c: (["train", c.cfg(init_from=str(c.tmp / "no_ckpt"))], ["init_from", "no_ckpt"])
    C["init_from:truncated-safetensors"] = init_truncated
    C["init_from:config-not-json"] = init_bad_json
    C["init_from:garbage-safetensors"] = init_garbage

    # out_dir
    C["out_dir:is-a-file"] = lambda c: ((c.tmp / "out").write_text("x") and ["train", c.cfg()],
                                        ["run.out_dir", "exists and is not a directory"])
    C["out_dir:checkpoints-is-a-file"] = lambda c: ((c.out.mkdir() or (c.out / "checkpoints").write_text("x")) and
                                                    ["train", c.cfg()], ["checkpoints", "is not a directory"])
    C["out_dir:parent-is-a-file"] = lambda c: ((c.tmp / "f").write_text("x") and
                                               ["train", c.cfg(run={"out_dir": str(c.tmp / "f" / "run")})],
                                               ["run.out_dir", "not writable"])
    if not torch.cuda.is_available():
        C["device:cuda-missing"] = lambda c: (["train", c.cfg(run={"device": "cuda"})],
                                              ["run.device: cuda:0 requested but CUDA is not available"])

    # convert
    C["convert:onto-its-run"] = lambda c: (c.run() and ["convert", "--to-hf", str(c.out), str(c.out)],
                                           ["is the source", "or inside it"])
    C["convert:inside-its-run"] = lambda c: (c.run() and ["convert", "--to-hf", str(c.out), str(c.out / "hf")],
                                             ["is the source", "or inside it"])
    C["convert:onto-its-run-overwrite"] = lambda c: (
        c.run() and ["convert", "--to-hf", str(c.out), str(c.out), "--overwrite"], ["--overwrite does not change"])
    C["convert:onto-checkpoint-dir"] = lambda c: (
        c.run() and ["convert", "--to-hf", str(c.ck(2)), str(c.out / "checkpoints")], ["contains the source"])
    C["convert:onto-parent-of-run"] = lambda c: (
        c.run() and ["convert", "--to-hf", str(c.out), str(c.tmp), "--overwrite"], ["contains the source"])
    C["convert:nonempty-out"] = lambda c: (
        c.run() and (c.tmp / "o").mkdir() or (c.tmp / "o" / "keep.txt").write_text("x") and
        ["convert", "--to-hf", str(c.out), str(c.tmp / "o")], ["o exists and is not empty", "--overwrite"])
    C["convert:onto-another-run-overwrite"] = lambda c: (
        c.run() and ["convert", "--to-hf", str(c.good_run), str(c.out), "--overwrite"],
        ["OUT_DIR", "is a q38 train run directory (it holds checkpoints)", "--overwrite does not change"])
    C["convert:out-is-a-file"] = lambda c: (
        c.run() and (c.tmp / "o.txt").write_text("x") and ["convert", "--to-hf", str(c.out), str(c.tmp / "o.txt")],
        ["o.txt exists and is a file"])
    C["convert:empty-src"] = lambda c: (["convert", "--to-hf", str(c.tmp), str(c.tmp / "hf")],
                                        ["holds no complete q38 checkpoint"])
    C["convert:missing-src"] = lambda c: (["convert", "--to-hf", str(c.tmp / "gone"), str(c.tmp / "hf")],
                                          ["gone does not exist"])
    C["convert:corrupt-checkpoint"] = lambda c: (
        c.run() and os.remove(c.ck(2) / ".metadata") or ["convert", "--to-hf", str(c.ck(2)), str(c.tmp / "hf")],
        ["step_000002 does not verify", ".metadata is missing"])
    C["convert:all-corrupt-run"] = lambda c: (
        c.run() and [os.remove(c.ck(s) / "manifest.json") for s in (1, 2)] and
        ["convert", "--to-hf", str(c.out), str(c.tmp / "hf")], ["holds no checkpoint that verifies"])
    C["convert:from-hf-no-config"] = lambda c: (["convert", "--from-hf", str(c.tmp), str(c.tmp / "ck")],
                                                ["is not a Hugging Face checkpoint directory (no config.json)"])

    def from_hf_mutate(mutate, needle):
        def build(c):
            hf = c.hf()
            mutate(hf)
            return ["convert", "--from-hf", str(hf), str(c.tmp / "ck")], [needle]
        return build

    C["convert:from-hf-config-not-json"] = from_hf_mutate(lambda h: (h / "config.json").write_text("]"),
                                                          "config.json is not valid JSON")
    C["convert:from-hf-truncated"] = from_hf_mutate(
        lambda h: (h / "model.safetensors").write_bytes((h / "model.safetensors").read_bytes()[:1000]),
        "model.safetensors")
    C["convert:from-hf-out-exists"] = lambda c: (["convert", "--from-hf", str(c.hf()), str(c.tmp)],
                                                 ["already exists"])
    C["convert:bad-dtype"] = lambda c: (["convert", "--to-hf", str(c.tmp), str(c.tmp / "o"), "--dtype", "float64"],
                                        ["--dtype must be float32, bfloat16 or float16"])
    C["convert:mtp-not-int"] = lambda c: (["convert", "--from-hf", "a", "b", "--mtp-num-layers", "x"],
                                          ["argument --mtp-num-layers: invalid int value"])
    C["convert:no-mode"] = lambda c: (["convert", "a", "b"], ["one of the arguments --to-hf --from-hf"])
    C["convert:both-modes"] = lambda c: (["convert", "--to-hf", "--from-hf", "a", "b"], ["not allowed with"])
    C["convert:missing-out"] = lambda c: (["convert", "--to-hf", "a"], ["the following arguments are required: out"])
    C["convert:unknown-flag"] = lambda c: (["convert", "--to-hf", "a", "b", "--frob"], ["unrecognized arguments"])
    C["init-hf:out-not-empty"] = lambda c: (["init-hf", "--model", "tiny", str(c.dir("o", "keep.txt"))],
                                            ["OUT_DIR", "o exists and is not empty", "--overwrite"])
    C["init-hf:onto-a-run-overwrite"] = lambda c: (c.run() and ["init-hf", str(c.out), "--overwrite"],
                                                   ["is a q38 train run directory", "--overwrite does not change"])
    C["init-hf:onto-a-checkpoint"] = lambda c: (c.run() and ["init-hf", str(c.ck(2)), "--overwrite"],
                                                ["is a q38 checkpoint directory"])
    C["init-hf:onto-its-model-yaml-dir"] = lambda c: (
        (c.dir("m") / "m.yaml").write_text("hidden_size: 8\n") and
        ["init-hf", "--model", str(c.tmp / "m" / "m.yaml"), str(c.tmp / "m"), "--overwrite"],
        ["contains the input", "m.yaml"])
    C["init-hf:unknown-preset"] = lambda c: (["init-hf", "--model", "tinyy", str(c.tmp / "n")],
                                             ["unknown model preset 'tinyy'"])
    C["init-hf:seed-not-int"] = lambda c: (["init-hf", "--seed", "x", str(c.tmp / "n")], ["argument --seed"])
    C["init-hf:bad-dtype"] = lambda c: (["init-hf", "--dtype", "int8", str(c.tmp / "n")], ["--dtype must be"])
    C["init-hf:no-out"] = lambda c: (["init-hf"], ["the following arguments are required: out"])

    # prepare-data: where it writes (dirs.check_output_dir), and a corpus with nothing to train
    def prep(out, *more):
        return lambda c: ["prepare-data", c.data('{"text": "a b c"}\n'), "--out", str(out(c)), *more]

    for name, out, more, needles in [
        ("nonempty-out", lambda c: c.dir("o", "notes.txt"), [], ["--out", "o exists and is not empty", "--overwrite"]),
        ("out-holds-the-input", lambda c: c.tmp, ["--overwrite"], ["contains the input", "data.jsonl"]),
        ("out-is-the-input", lambda c: c.tmp / "data.jsonl", ["--overwrite"], ["is the input", "data.jsonl"]),
        ("out-is-a-run", lambda c: c.run(), [], ["is a q38 train run directory (it holds checkpoints)"]),
        ("out-is-a-run-overwrite", lambda c: c.run(), ["--overwrite"], ["--overwrite does not change this"]),
        ("out-has-a-metrics-log", lambda c: c.dir("r", "metrics.jsonl"), ["--overwrite"], ["(it holds metrics.jsonl)"]),
        ("out-has-a-run-lock", lambda c: c.dir("r", ".q38.lock"), ["--overwrite"], ["(it holds .q38.lock)"]),
        ("out-is-a-checkpoint", lambda c: c.run() and c.ck(2), ["--overwrite"],
         ["step_000002 is a q38 checkpoint directory", "would break the checkpoint"]),
        ("out-inside-a-checkpoint", lambda c: c.run() and c.ck(2) / "data", [], ["or inside one"]),
        ("out-is-a-checkpoints-dir", lambda c: c.run() and c.out / "checkpoints", ["--overwrite"],
         ["holds q38 checkpoints (step_00000"]),
    ]:
        C[f"prepare:{name}"] = (lambda build, needles: lambda c: (build(c), needles))(prep(out, *more), needles)

    def prep_inside_input_dir(c):
        d = c.dir("in")
        (d / "a.jsonl").write_text('{"text": "a"}\n')
        return ["prepare-data", str(d), "--out", str(d / "prepared"), "--overwrite"], ["is the input", "or inside it"]

    C["prepare:out-inside-an-input-dir"] = prep_inside_input_dir
    C["prepare:no-trainable-target"] = lambda c: (
        ["prepare-data", c.data('{"messages": [{"role": "user", "content": "hi"}]}\n'), "--out", str(c.tmp / "o")],
        ["hold 1 documents but no trainable target under --train-on assistant", "pass --train-on all"])
    C["prepare:no-trainable-target-last-assistant"] = lambda c: (
        ["prepare-data", c.data('{"messages": [{"role": "system", "content": "be brief"}]}\n'), "--out",
         str(c.tmp / "o"), "--train-on", "last_assistant"], ["no trainable target under --train-on last_assistant"])
    C["prepare:bad-train-on"] = lambda c: (["prepare-data", c.data("{}"), "--out", "o", "--train-on", "users"],
                                           ["argument --train-on: invalid choice: 'users'"])

    # data checked against the model on the data itself
    def shard_with_token(tok):
        def build(c):
            d = c.shards()
            f = d / "shard_000000.tokens"
            a = __import__("numpy").fromfile(f, dtype="<u2")
            a[70] = tok  # the manifest still says max_token_id 258 (eos)
            a.tofile(f)
            return ["train", c.cfg(data={"path": str(d)})], ["shard_000000.tokens holds token id 60000 >= the "
                                                             "model's vocab_size 384 at token 70 (row 2 of the shard "
                                                             "at seq_len 32)", "re-run `q38 prepare-data"]
        return build

    C["data:shard-token-beyond-vocab"] = shard_with_token(60000)
    C["data:shard-prepared-with-another-train-on"] = lambda c: (
        ["train", c.cfg(data={"path": str(c.shards()), "train_on": "all"})],
        ["was prepared with --train-on assistant but data.train_on is all", "set data.train_on: assistant"])
    C["ckpt:resume_from-with-resume-false"] = lambda c: (
        c.run() and ["train", c.cfg(run={"steps": 4, "resume": False, "resume_from": str(c.ck(2))})],
        ["run.resume_from is", "step_000002", "but run.resume is false", "set run.resume: true"])

    # plan
    P = ["plan", "--model", "tiny", "--layout", "fsdp"]
    for opt, bad, want in [("--seq-len", "0", "must be a positive integer, got 0"),
                           ("--seq-len", "-8", "must be a positive integer, got -8"),
                           ("--global-batch", "0", "must be a positive integer, got 0"),
                           ("--micro-batches", "0", "must be a positive integer, got 0"),
                           ("--micro-batches", "-1", "must be a positive integer, got -1"),
                           ("--world", "0", "must be a positive integer, got 0"),
                           ("--optimizer-states", "-1", "must be an integer >= 0, got -1"),
                           ("--seq-len", "1.5", "invalid int value: '1.5'")]:
        argv = P + ["--world", "2"] + [opt, bad] if opt != "--world" else P + [opt, bad]
        C[f"plan:{opt[2:]}={bad}"] = (lambda argv, needle: lambda c: (argv, [needle]))(argv, f"argument {opt}: {want}")
    S = ["plan", "--model", "tiny", "--world", "2", "--search", "--hardware", "h200"]
    C["plan:memory-cap-0"] = lambda c: (S + ["--memory-cap", "0"], ["argument --memory-cap: must be a positive"])
    C["plan:memory-cap-nan"] = lambda c: (S + ["--memory-cap", "nan"], ["argument --memory-cap: must be a positive"])
    C["plan:memory-cap-without-search"] = lambda c: (P + ["--world", "2", "--memory-cap", "10"],
                                                     ["--memory-cap applies only to q38 plan --search"])
    C["plan:train-missing"] = lambda c: (P + ["--world", "2", "--train", "nope.yaml"],
                                         ["--train nope.yaml: file not found"])
    C["plan:layout-file-missing"] = lambda c: (["plan", "--model", "tiny", "--layout", "my/layout.yaml", "--world",
                                                "2"], ["--layout my/layout.yaml: file not found"])
    C["plan:model-file-missing"] = lambda c: (["plan", "--model", "m.yaml", "--layout", "fsdp", "--world", "2"],
                                              ["--model m.yaml: file not found"])
    C["plan:hardware-file-missing"] = lambda c: (P + ["--world", "2", "--hardware", "hw/x.yaml"],
                                                 ["--hardware hw/x.yaml: file not found"])
    C["plan:layout-not-yaml"] = lambda c: (["plan", "--model", "tiny", "--layout", c.data("mesh: [unclosed\n", "l.yaml"),
                                            "--world", "2"], ["--layout", "l.yaml: not valid YAML", "line 2"])
    C["plan:model-not-yaml"] = lambda c: (["plan", "--model", c.data("a: [1,\n", "m.yaml"), "--layout", "fsdp",
                                           "--world", "2"], ["--model", "m.yaml: not valid YAML"])
    C["plan:train-not-yaml"] = lambda c: (P + ["--world", "2", "--train", c.data("data: {", "t.yaml")],
                                          ["--train", "t.yaml: not valid YAML"])
    C["plan:train-a-list"] = lambda c: (P + ["--world", "2", "--train", c.data("- 1\n", "t.yaml")],
                                        ["--train", "t.yaml: expected a run config mapping"])
    C["plan:hardware-not-yaml"] = lambda c: (P + ["--world", "2", "--hardware", c.data("peak: [", "h.yaml")],
                                             ["--hardware", "h.yaml: not valid YAML"])
    C["plan:search-out-not-empty"] = lambda c: (S + ["--out", str(c.dir("o", "notes.txt"))],
                                                ["--out", "o exists and is not empty", "--overwrite"])
    C["plan:search-out-a-run"] = lambda c: (S + ["--out", str(c.run()), "--overwrite"],
                                            ["is a q38 train run directory"])
    C["plan:search-out-holds-the-train-config"] = lambda c: (
        S + ["--train", c.cfg(), "--out", str(c.tmp), "--overwrite"], ["contains the input", "run.yaml"])
    C["plan:overwrite-without-search"] = lambda c: (P + ["--world", "2", "--overwrite"],
                                                    ["--overwrite applies only to q38 plan --search"])
    C["plan:world-not-int"] = lambda c: (P + ["--world", "abc"], ["argument --world: invalid int value: 'abc'"])
    C["plan:no-world"] = lambda c: (P, ["the following arguments are required: --world"])
    C["plan:no-model"] = lambda c: (["plan", "--layout", "fsdp", "--world", "2"], ["--model"])
    C["plan:unknown-model"] = lambda c: (["plan", "--model", "nosuch", "--layout", "fsdp", "--world", "2"],
                                         ["unknown model preset 'nosuch'"])
    C["plan:unknown-layout"] = lambda c: (["plan", "--model", "tiny", "--layout", "nosuch", "--world", "2"],
                                          ["nosuch"])
    C["plan:bad-dtype"] = lambda c: (P + ["--world", "2", "--dtype", "fp64"], ["argument --dtype: invalid choice"])
    C["plan:bad-mesh"] = lambda c: (P + ["--world", "2", "--mesh", "ep"], ["--mesh expects name=size pairs"])
    C["plan:world-misfit"] = lambda c: (["plan", "--model", "tiny", "--layout", "fsdp_ep", "--world", "3"],
                                        ["fsdp_ep"])
    C["plan:optimizer-states-not-int"] = lambda c: (P + ["--world", "2", "--optimizer-states", "x"],
                                                    ["argument --optimizer-states"])
    C["plan:unknown-flag"] = lambda c: (P + ["--world", "2", "--frob"], ["unrecognized arguments: --frob"])
    return C


CASES = _cases()


def test_at_least_100_cases_across_every_area():
    areas = {k.split(":")[0].split("-")[0] for k in CASES}
    assert len(CASES) >= 100, len(CASES)
    assert {"set", "config", "data", "ckpt", "metrics", "init_from", "out_dir", "convert", "plan", "prepare",
            "init"} <= areas, areas


# Cases that get as far as a training step (the run's out_dir gets its metrics log); every other case changes
# nothing on disk.
RUNS_A_STEP = {"data:shard-token-beyond-vocab"}


def _tree(root: Path, files_only: bool) -> dict[str, tuple]:
    """Every path under ``root`` with its size and mtime (``files_only``: files, without the run lock, which
    ``q38 train`` creates before it reads the config's data)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_dir() and not files_only:
            out[str(p.relative_to(root))] = ("dir",)
        elif p.is_file() and not (files_only and p.name == ".q38.lock"):
            st = p.stat()
            out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


def _assert_one_line(rc: int, err: str, cmd: str, needles) -> None:
    err = err.strip()
    assert rc == 2, err
    assert err and "\n" not in err, err
    assert err.startswith(f"q38 {cmd}") and ": error: " in err, err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, (n, err)


@pytest.mark.filterwarnings("ignore:.*is a run setting now")  # legacy model-config kernel keys map with a note
@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_exit_2(name, tmp_path, good_run, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv, needles = CASES[name](Ctx(tmp_path, good_run))
    capsys.readouterr()  # drop the output of building the case (e.g. a convert)
    train = argv[0] == "train"  # (q38 train makes run.out_dir and its checkpoints/ before it reads the data)
    before = _tree(tmp_path, files_only=train)
    rc = main(argv)
    _assert_one_line(rc, capsys.readouterr().err, argv[0], needles)
    if name not in RUNS_A_STEP:
        assert _tree(tmp_path, files_only=train) == before, "the refused command changed files on disk"


# One case per command and kind of failure (a config value, a checkpoint read, plan, convert, prepare-data): the
# in-process test above runs every case; these check that a real process says the same one line and exits 2.
@pytest.mark.parametrize("name", ["set:train.beta1=2", "plan:world-not-int", "convert:onto-its-run",
                                  "ckpt:resume_from-truncated-shard", "prepare:out-is-a-checkpoint"])
def test_bad_input_as_a_real_subprocess(name, tmp_path, good_run):
    argv, needles = CASES[name](Ctx(tmp_path, good_run))
    r = q38(*argv)
    _assert_one_line(r.returncode, r.stderr, argv[0], needles)


def test_debug_prints_the_traceback(tmp_path, good_run, capsys, monkeypatch):
    argv, _ = CASES["set:train.beta1=2"](Ctx(tmp_path, good_run))
    assert main(argv + ["--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("q38 train: error: train.beta1")
    monkeypatch.setenv("Q38_DEBUG", "1")
    assert main(argv) == 2
    assert "Traceback" in capsys.readouterr().err


def test_an_unexpected_error_is_one_line_exit_1(monkeypatch, capsys):
    import q38.cli

    def boom(argv):
        raise RuntimeError("something\nbroke")

    monkeypatch.setitem(q38.cli.COMMANDS, "plan", boom)
    assert main(["plan"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "internal error: RuntimeError: something broke" in err and "--debug" in err


def test_a_held_lock_names_its_holder(tmp_path, good_run, capsys):
    """An out_dir locked by another process (here a second open file description in this process) is refused."""
    c = Ctx(tmp_path, good_run)
    cfg = c.cfg()
    c.out.mkdir()
    fd = os.open(c.out / ".q38.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    (c.out / ".q38.lock.holder").write_text("otherhost pid 4242 since 2026-01-01T00:00:00\n")
    try:
        rc = main(["train", cfg])
    finally:
        os.close(fd)
    _assert_one_line(rc, capsys.readouterr().err, "train",
                     ["is in use by another q38 train run", "otherhost pid 4242", str(c.out)])
    assert not (c.out / "metrics.jsonl").exists() and not any((c.out / "checkpoints").iterdir())

