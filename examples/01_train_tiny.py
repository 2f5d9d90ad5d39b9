"""Train the `tiny` preset from Python instead of the CLI, then sample from it.

    python examples/01_train_tiny.py max_steps=100
"""

import sys

from jaxperf.config import get_config
from jaxperf.train.trainer import Trainer

cfg = get_config("tiny", ["run_dir=runs/example-tiny", *sys.argv[1:]])
trainer = Trainer(cfg)
summary = trainer.fit()
print(f"final loss {summary['final_loss']:.3f}, {summary.get('tokens_per_sec', 0):,.0f} tokens/s")
print(trainer.sample(summary["state"], "import ", 120))
