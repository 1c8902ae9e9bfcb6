"""The stage programs, one per pipeline stage, and what they share.

Every entry here except `common/` is a stage program, run as
`python -m alignflow.stages.<program> --spec SPEC` (`main(argv) -> int` parses and calls
`run(spec) -> StageResult`): data/, base_model.py (the "base" stage), sft.py, reward.py, engine.py (builds
the generation engine), ppo/ (PPO and GRPO), dpo/, evaluate.py. A stage with parts of its own is a package
that holds them (ppo/ its losses and rollout workers, dpo/ its preference losses). `common/` holds what
several stages use: the stage runtime, ranks, devices, the generation engines, model loading and the
training helpers. `python -m alignflow.stages <stage>` runs a stage by its name.
"""
