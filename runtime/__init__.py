"""alpa_like.runtime: device meshes, executables and backends."""
