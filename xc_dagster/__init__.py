"""xc-dagster: deep extreme classification (NGAME, SiameseXML, ASTRA, MIPS-s) as one modular pipeline.

The library under this package has no Dagster import, except ``xc_dagster.definitions`` which wires the
Dagster layer (``assets/``, ``resources/``) together.
"""

__version__ = "0.1.0"
