"""Storage: every file a run reads or writes, local or gs:// (files.py, whose functions are
exported here: `from jaxprefix import storage; storage.write_atomic(...)`); transient vs
permanent GCS failures and their retries (faults.py, `storage.faults`); one run per workdir
(workdir_lock.py, imported where a job holds its workdir)."""
from jaxprefix.storage import faults
from jaxprefix.storage.files import (
    BACKENDS, CACHE_ENV, PLACEHOLDER_BUCKETS, basename, cache_dir, create_exclusive, dirname,
    exists, glob, is_placeholder, is_remote, isdir, isfile, join, listdir, local_copy, makedirs,
    modified_ns, open, open_atomic, read_bytes, read_json, read_text, remove,
    remove_orphaned_temporaries, rename, require_backend, rmtree, size, write_atomic,
    write_figure, write_json)

__all__ = ['BACKENDS', 'CACHE_ENV', 'PLACEHOLDER_BUCKETS', 'basename', 'cache_dir',
           'create_exclusive', 'dirname', 'exists', 'faults', 'glob', 'is_placeholder',
           'is_remote', 'isdir', 'isfile', 'join', 'listdir', 'local_copy', 'makedirs',
           'modified_ns', 'open', 'open_atomic', 'read_bytes', 'read_json', 'read_text',
           'remove', 'remove_orphaned_temporaries', 'rename', 'require_backend', 'rmtree', 'size', 'write_atomic',
           'write_figure', 'write_json']
