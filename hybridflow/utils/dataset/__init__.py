"""Datasets in verl's parquet schema and a resumable data loader."""

from hybridflow.utils.dataset.dataloader import StatefulDataLoader
from hybridflow.utils.dataset.rl_dataset import RLHFDataset, collate_fn

__all__ = ["RLHFDataset", "StatefulDataLoader", "collate_fn"]
