"""fused_rl benchmark suite: ``python bench/run.py --help`` (see ``bench/run.py``)."""
