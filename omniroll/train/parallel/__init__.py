"""The data-parallel update: the trainer ranks (Ray actors), their process group, the batch split over them, FSDP2."""
