"""torch.distributed for tensor parallelism: a rank's group and its collectives (`group.py`), how a model's
heads and vocabulary split over the ranks (`partition.py`), and the rendezvous (`rendezvous.py`)."""
