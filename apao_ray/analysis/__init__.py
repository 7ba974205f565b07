"""Studies after the fact: paired significance (stats), a compact export of a study (export), the report."""
