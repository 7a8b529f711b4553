"""Every choice list of the configuration, in one place (pure python: config validation, the
accounting package and the command-line tools read these names, and none keeps a copy).

The mechanisms' own tables stay with the mechanisms (``strategies.mechanisms``): the client-level
refactorizations are its ``CLIENT_REFACTORIZATION`` keys.
"""

from __future__ import annotations

from strategies.mechanisms import CLIENT_REFACTORIZATION, METHODS

#: Server strategies (``strategy.name``): the methods of ``strategies.mechanisms.METHODS``.
STRATEGIES = tuple(METHODS)
#: Methods the server-side accountant plans (FedSVD has no server-side noise: DP-SGD or none only).
ACCOUNTED_METHODS = tuple(name for name, m in METHODS.items() if m.accounted)
DP_LEVELS = ("none", "sample", "client")
#: Where sample-level noise is added: DP-SGD on every silo, or the paper's server-side noise.
NOISE_AT = ("silo", "server")
#: Where every noise draw and sampling coin comes from (strategies.noise.NOISE_MODES).
NOISE_MODES = ("hardened", "seeded")
#: What a private run shows beyond its guarantee (strategies.privacy_contract.Disclosure).
DIAGNOSTICS = ("off", "released")
ACCOUNTANTS = ("rdp", "pld")
SAMPLE_MODES = ("two-stage", "product")
CALIBRATIONS = ("rigorous", "paper")
CLIENT_REFACTORIZATIONS = tuple(CLIENT_REFACTORIZATION)
TASKS = ("synthetic", "sst2", "qnli", "mnli", "qqp", "text")
#: How the silos of a simulation are cut (task.partitioner): this project's split (IID, or its
#: size-preserving Dirichlet split when task.dirichlet-alpha > 0), or flwr-datasets' partitioners.
PARTITIONERS = ("fedpower", "iid", "dirichlet")
#: What the console, the curves and the tables lead with (task.metric); every run reports all three.
METRICS = ("accuracy", "macro-f1", "balanced-accuracy")
DEVICES = ("auto", "cpu", "cuda")
LR_SCHEDULES = ("constant", "cosine")
LOCAL_OPTIMIZERS = ("adam", "sgd")
OPTIMIZER_STATES = ("round", "run")
PRECISIONS = ("auto", "fp32", "bf16")  # train.precision: the forward under bf16 autocast or not
POOLINGS = ("pooler", "mean")
#: What a silo trains (``train.what``): the LoRA adapters (and the head when it trains), a linear head
#: alone on frozen sentence features, or that head first and then the adapters (LP-FT).
TRAIN_WHAT = ("adapters", "head", "head-then-adapters")
