"""specserve.training — corpora, tokenizer, LM training, self-distillation data, draft models, the bundle.

One job per module (import what you need; nothing heavy is imported here):

- ``corpus``       local text/code files (default: this interpreter's stdlib), split by module, manifest
- ``tokenizer``    byte-level BPE via `tokenizers`, saved as a transformers tokenizer (EOS, chat template)
- ``presets``      model shapes and training settings (``tiny``, ``small``; draft presets), validation
- ``data``         token streams and deterministic, resumable batches
- ``trainer``      the shared loop: AdamW + cosine, CUDA bf16 autocast, torchrun DDP, logs, checkpoints
- ``setup``        what every ``train_*`` entry point shares: `RunOptions` (device, budget, resume/force,
                   overrides), the process group, a drafter run's output directory and data, the summary
- ``lm``           ``specserve train lm``
- ``distill``      ``specserve train distill-data``
- ``draft``        ``specserve train draft`` (served by the ``draft`` drafter, `specserve.drafters.draft_model`)
- ``bundle``       ``specserve train bundle``: the embedded default model and its draft model
- ``cli``          the ``train`` subcommands

Where the bundle lives is the runtime's `specserve.bundle_paths`; `specserve.evals.default_drafter` picks
the bundle's default drafter (``specserve train default-drafter``).

See training/README.md for the commands, the presets' measured figures and how the bundle is made.
"""
