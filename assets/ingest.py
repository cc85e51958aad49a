"""Dataset ingest: the source (local, file://, http(s)://, fsspec) parsed from its XC layout into canonical tables -- point and label texts, train/test label matrices (CSR), filter pairs, BoW features -- plus the validation split carved from train."""

from assets._stage import stage_asset

build = stage_asset("ingest", "dataset", deps=[],
                    group="data", kinds={"python", "parquet"}, description=__doc__)
