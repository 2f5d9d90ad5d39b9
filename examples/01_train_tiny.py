"""Train the `tiny` preset from Python instead of the CLI, then sample from it.

    python examples/01_train_tiny.py max_steps=100
"""

import sys

from jaxperf.config import get_config
from jaxperf.perf import reexec_with_huge_pages
from jaxperf.train.trainer import Trainer

reexec_with_huge_pages()  # on CPU hosts: restart once so XLA's step buffers get huge pages (jaxperf.perf.cpu_host)
cfg = get_config("tiny", ["run_dir=runs/example-tiny", *sys.argv[1:]])
trainer = Trainer(cfg)
summary = trainer.fit()
print(f"final loss {summary['final_loss']:.3f}, {summary.get('tokens_per_sec', 0):,.0f} tokens/s")
print(trainer.sample(summary["state"], "import ", 120))
