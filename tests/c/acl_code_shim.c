/* A libascendcl.so in front of the simulator's: aclrtMallocAlign32 answers the code set with
   shim_set_code (0: the simulator's own answer), every other call is the simulator's (found in
   this library's dependency by dlsym). Lets a test see the acl backend's text for a runtime
   code the simulator never gives on that path. */
#include <stddef.h>

int aclrtMallocAlign32(void **ptr, size_t size, int policy);

static int code;

void shim_set_code(int c) { code = c; }

int aclrtMallocAlign32(void **ptr, size_t size, int policy)
{
    (void)ptr; (void)size; (void)policy;
    return code;
}
