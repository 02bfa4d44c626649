"""models.HuggingFaceCausalLM under `trainingrun local`: transformers' GPT-2 and Llama from random weights, named in a
TrainingRun with no code of the user's, train with DDP and with FSDP2 and activation checkpointing, and a run whose
worker is killed resumes to the bitwise same model as the run that was not."""

import re
import subprocess
import sys

import pytest
import yaml

from environments import inherited
from tiny_runs import tiny_trainer
from trainingrun_trainer.checkpoint import CheckpointStore

pytest.importorskip("transformers", reason="transformers is not installed (the huggingface extra): make setup has it")

GPT2 = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 128, "n_positions": 32}
LLAMA = {
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 128,
    "max_position_embeddings": 32,
}


def run_file(tmp_path, config_class, config, **trainer):
    body = {
        "apiVersion": "trainingrun.dev/v1alpha1",
        "kind": "TrainingRun",
        "metadata": {"name": "hf"},
        "spec": {
            "trainer": tiny_trainer(
                maxSteps=30,
                deterministic=True,
                model={
                    "classPath": "trainingrun_trainer.models.HuggingFaceCausalLM",
                    "initArgs": {"configClass": config_class, "config": config, "contextLength": 16},
                },
                **trainer,
            ),
            "checkpoint": {"uri": "file:///unused", "interval": {"steps": 10}},
            "nprocPerNode": 2,
            "recovery": {"backoffSeconds": 0},
        },
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def local(tmp_path, path, checkpoints, *flags):
    command = [
        sys.executable,
        "-m",
        "trainingrun_operator.cli",
        "local",
        str(path),
        "--runs-dir",
        str(tmp_path / "runs"),
    ]
    command += ["--checkpoint-uri", f"file://{tmp_path}/{checkpoints}", *flags]
    done = subprocess.run(command, env=inherited("TRAININGRUN_"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def final_digest(tmp_path, checkpoints):
    return {i.step: i for i in CheckpointStore(f"file://{tmp_path}/{checkpoints}").list() if i.valid}[30].model_digest


@pytest.mark.slow
@pytest.mark.parametrize(
    "config_class,config,trainer",
    [
        ("transformers.GPT2Config", GPT2, {}),
        ("LlamaConfig", LLAMA, {"strategy": "fsdp2", "activationCheckpointing": True}),
    ],
    ids=["gpt2-ddp", "llama-fsdp2-activation-checkpointing"],
)
def test_a_transformers_causal_lm_trains_and_resumes_bitwise_after_a_kill(tmp_path, config_class, config, trainer):
    path = run_file(tmp_path, config_class, config, **trainer)
    reference = local(tmp_path, path, "reference")
    killed = local(tmp_path, path, "killed", "--chaos-kill-step", "15")
    assert re.search(r"chaos: SIGKILL worker rank \d at step 15", killed), killed[-3000:]
    assert re.search(r"resumed from step 10 ", killed), killed[-3000:]
    assert final_digest(tmp_path, "killed") == final_digest(tmp_path, "reference")
    # It learns: the loss falls from about ln(128) = 4.85, random weights' over 128 tokens.
    losses = [float(x) for x in re.findall(r"step \d+/30 loss ([0-9.]+)", reference)]
    assert 4.5 < losses[0] < 5.2 and losses[-1] < losses[0] - 0.05, reference[-2000:]
    # Model FLOPs counted (GPT-2's Conv1D layers included): a CPU shows TFLOP/s and no MFU.
    assert re.search(r"^throughput: [0-9.]+ samples/s, [0-9.e-]+ TFLOP/s, MFU - ", reference, re.MULTILINE)
