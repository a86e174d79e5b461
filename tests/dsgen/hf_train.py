"""Train a tiny Llama with the Hugging Face ``Trainer`` on DeepSpeed (CPU), optionally as a PEFT LoRA.

Run under torchrun (one process per data-parallel rank):

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node W \
        tests/dsgen/hf_train.py '<spec as JSON>' OUTDIR

OUTDIR is the Trainer's ``output_dir``; it ends up with:

    base/                 the base model before training (``save_pretrained``, fp32) and a tokenizer
    checkpoint-N/         what the Trainer saved: global_stepN/, latest, config.json,
                          generation_config.json, tokenizer files (adapter_config.json for PEFT)
    with-frozen/          PEFT only: the same engine saved with save_checkpoint() as it is (frozen
                          base weights included), plus a copy of adapter_config.json
    ground_truth.pt       from DeepSpeed's own view after training (never from the files):
        trainable   name -> fp32 master (safe_get_full_fp32_param), engine-module names
        frozen      name -> gathered value in the model dtype
        buffers     name -> persistent buffer
        tied        alias -> source (named_parameters without de-duplication)
        state_dict_keys, model_dtype, stage, world_size, checkpoint (the folder name), spec

Spec keys: stage (2|3), dtype ("bf16"|"fp32"), peft (bool), tied (bool), steps, world_size.
"""
import json
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

VOCAB = 48
SEQ = 8


def tiny_config(tied: bool):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def tiny_tokenizer():
    """A word-level tokenizer made here: nothing can be downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int):
        gen = torch.Generator().manual_seed(7)
        self.ids = torch.randint(4, VOCAB, (n, SEQ), generator=gen)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def ds_config(spec: dict) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto", "gradient_clipping": "auto",
        "zero_optimization": {"stage": spec["stage"]},
        "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
    }
    if spec["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def main():
    spec = json.loads(sys.argv[1])
    outdir = Path(sys.argv[2])
    from accelerate import PartialState

    from gloo_job import process_group  # this folder is first on sys.path: the script runs as a file

    # The Trainer would pick NCCL; a CPU run needs gloo, set up before the Trainer exists, and
    # marked as DeepSpeed's (else TrainingArguments refuses the configured state).
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    with process_group(lambda: PartialState(backend="gloo")):  # barrier, then torn down
        train(spec, outdir, PartialState())  # accelerate's shared state: the one just made


def train(spec, outdir, state):
    rank, world = state.process_index, state.num_processes
    assert world == spec["world_size"], (world, spec["world_size"])

    import transformers
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    base_dir = outdir / "base"
    if rank == 0:
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_config(tiny_config(spec["tied"]))
        base.save_pretrained(base_dir)
        tiny_tokenizer().save_pretrained(base_dir)
    state.wait_for_everyone()

    bf16 = spec["dtype"] == "bf16"
    if bf16:  # TrainingArguments refuses bf16 without a GPU; DeepSpeed's CPU accelerator runs it
        transformers.training_args.is_torch_bf16_gpu_available = lambda: True
    steps = int(spec.get("steps", 2))
    args = TrainingArguments(
        output_dir=str(outdir), per_device_train_batch_size=2, max_steps=steps, save_steps=steps,
        save_strategy="steps", learning_rate=1e-2, bf16=bf16, deepspeed=ds_config(spec), report_to="none",
        logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0,
        accelerator_config={"use_configured_state": True})
    # After TrainingArguments: at ZeRO-3 from_pretrained then builds the model partitioned.
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if spec["peft"]:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"],
                          task_type="CAUSAL_LM")
        model = get_peft_model(model, lora)
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(16),
                      processing_class=transformers.AutoTokenizer.from_pretrained(base_dir))
    trainer.train()
    if spec["peft"]:
        # The same weights saved as DeepSpeed saves them when asked directly: frozen base included.
        with_frozen = outdir / "with-frozen"
        trainer.model_wrapped.save_checkpoint(str(with_frozen), tag=f"global_step{steps}")
        if rank == 0:
            shutil.copy(outdir / f"checkpoint-{steps}" / "adapter_config.json", with_frozen)
    write_truth(trainer, spec, outdir, rank, world, steps)


def write_truth(trainer, spec, outdir, rank, world, steps):
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    engine = trainer.model_wrapped
    module = engine.module
    first, tied = {}, {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied[name] = first[id(p)]
        else:
            first[id(p)] = name
    trainable, frozen = {}, {}
    for name, p in module.named_parameters():  # same order on every rank: the gathers are collectives
        shape = p.ds_shape if hasattr(p, "ds_id") else p.shape
        if p.requires_grad:
            trainable[name] = safe_get_full_fp32_param(p).detach().float().cpu().clone().reshape(shape)
        elif hasattr(p, "ds_id"):
            with deepspeed.zero.GatheredParameters([p]):
                frozen[name] = p.detach().cpu().clone()
        else:
            frozen[name] = p.detach().cpu().clone()
    keys = list(module.state_dict().keys())
    buffers = {n: b.detach().cpu().clone() for n, b in module.named_buffers() if n in set(keys)}
    if rank != 0:
        return
    p0 = next(module.parameters())
    held = p0.ds_tensor.dtype if hasattr(p0, "ds_id") else p0.dtype
    truth = {"trainable": trainable, "frozen": frozen, "buffers": buffers, "tied": tied, "state_dict_keys": keys,
             "model_dtype": str(held).removeprefix("torch."), "stage": spec["stage"], "world_size": world,
             "checkpoint": f"checkpoint-{steps}", "spec": spec, "ds_version": deepspeed.__version__}
    tmp = outdir / "ground_truth.pt.tmp"
    torch.save(truth, tmp)
    torch.load(tmp, weights_only=True)
    os.replace(tmp, outdir / "ground_truth.pt")


if __name__ == "__main__":
    from gloo_job import exit_now

    main()
    exit_now()  # torn down and written: no finalization (tests/dsgen/gloo_job.py)
