"""DDP-aware compilation: bucket planning (`ddp.bucketing`), graph splitting (`ddp.splitter`),
reducer alignment (`ddp.alignment`) and the opt-in overlap recorder (`ddp.overlap`)."""
