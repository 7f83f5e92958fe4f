"""The HAProxy master process and its workers: `process.MasterProcess` owns them."""
