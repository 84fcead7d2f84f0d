"""The benchmark suite: Alpa's evaluation (dissertation ch. 3, Tables 3.6-3.8, Figs. 3.7-3.9) with the
seeds' baselines, planned and simulated under one cost model; run ``python -m alpa_like.bench --help``."""
