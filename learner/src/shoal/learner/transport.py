"""Deprecated alias of :mod:`shoal.contract.wire`, the tensor-bundle wire codec.

The codec moved to the client distribution because the learner and the parameter-sync shards
both speak it (services no longer import the learner package for it). This module re-exports
its public names so that scripts written against ``shoal.learner.transport`` keep working.
"""

from shoal.contract.wire import *  # noqa: F403
from shoal.contract.wire import __all__  # noqa: F401
