"""Export as a feature: a checkpoint `omniroll train` wrote, as files diffusers loads (layer 8.5, above `train/`: it
reads the trainer's checkpoints).

    write.py  the export: a LoRA file (`load_lora_weights`) or, with `--merge`, a whole pipeline directory
    check.py  `omniroll export --check`: the export loaded by diffusers, against omniroll's engine
"""
