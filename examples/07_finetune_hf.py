"""Fine-tune a Hugging Face model with jaxperf on a text file, export it, and generate from it with transformers.

    python examples/07_finetune_hf.py                                    # a random tiny Llama built here (no network)
    python examples/07_finetune_hf.py --model path/to/hf-llama --text notes.txt max_steps=200 seq_len=256
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/07_finetune_hf.py    # fsdp over 8 CPU devices

The model directory holds config.json, model*.safetensors and tokenizer.json (what `save_pretrained` writes for a
GPT-2 or Llama). Without --model, a random tiny Llama and a byte-level BPE trained on the text are saved first. Needs
transformers and torch (pip install 'jaxperf[hf]'); jaxperf itself reads the weights without them.
"""

import argparse
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxperf.config import get_config
from jaxperf.generate import Generator
from jaxperf.train.pretrained import export_run
from jaxperf.train.trainer import Trainer


def tiny_llama(directory: Path, text: str) -> None:
    """A random 2-layer Llama with a BPE tokenizer trained on `text`, saved as a Hugging Face model directory."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator([text], trainer=trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    config = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=176,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, bos_token_id=0, eos_token_id=1)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    tok.save(str(directory / "tokenizer.json"))


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", help="a Hugging Face GPT-2 / Llama directory (default: build a random tiny Llama)")
parser.add_argument("--text", default=str(Path(__file__).resolve().parents[1] / "README.md"), help="text to train on")
parser.add_argument("--out", default="runs/example-finetune-hf", help="where the run and the export go")
parser.add_argument("overrides", nargs="*", help="config overrides, key=value (e.g. max_steps=200 seq_len=256)")
args = parser.parse_args()
out = Path(args.out)
model_dir = Path(args.model) if args.model else out / "tiny-llama"
if not args.model and not (model_dir / "config.json").exists():
    tiny_llama(model_dir, Path(args.text).read_text())

# 1. Train: the model, its weights (straight into their shards) and its tokenizer come from the directory.
cfg = get_config("tiny", [f"run_dir={out / 'run'}", f"data.source={args.text}", "seq_len=128", "max_steps=60",
                          "optim.schedule=constant", "lr=1e-3", "eval_every=0", "sample_tokens=0", *args.overrides])
summary = Trainer(cfg, init_from=str(model_dir)).fit()
print(f"loss {summary['losses'][min(summary['losses'])]:.3f} -> {summary['final_loss']:.3f}")

# 2. Export: config.json with the special token ids, generation_config.json, safetensors shards, the tokenizer.
export_run(out / "run", out / "exported")

# 3. Generate greedily with transformers from the export, and with jaxperf from the run: the same tokens.
tokenizer = transformers.AutoTokenizer.from_pretrained(out / "exported")
model = transformers.AutoModelForCausalLM.from_pretrained(out / "exported").eval()
prompt = tokenizer("jaxperf is", add_special_tokens=False)["input_ids"]
with torch.no_grad():
    theirs = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                            pad_token_id=model.config.eos_token_id)[0, len(prompt):].tolist()
ours = Generator.from_checkpoint(out / "run").generate([prompt], max_tokens=24, temperature=0.0)[0].tokens
print("transformers:", repr(tokenizer.decode(theirs)))
print("jaxperf:     ", repr(tokenizer.decode(ours)), "(same tokens)" if ours == theirs else "(DIFFERENT tokens)")
