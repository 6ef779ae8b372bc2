"""Training data: sources → GPT-2 BPE → packed windows in one global order, independent of dp.

The loop reads `TrainBatches` and `validation_batches` (batches.py); the config checks call
`check_data` (probe.py). `DataError` is a bad data setting or a bad record under
data.on_bad_record=error; `DataUnavailable` (reading.py), a data file, or a Hub request, that stayed unreadable.
"""

from train.data.batches import TrainBatches, validation_batches
from train.data.probe import check_data
from train.data.reading import DataUnavailable
from train.data.sources import DataError, check_data_config

__all__ = ["DataError", "DataUnavailable", "TrainBatches", "check_data", "check_data_config", "validation_batches"]
