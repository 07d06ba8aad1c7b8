import time, sys
t1=time.perf_counter()
from edgellm.entry import import_frozen
import_frozen('edgellm.cli')
print('script-top', round(time.perf_counter()-t1,3))
