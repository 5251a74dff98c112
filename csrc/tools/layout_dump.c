/* Prints every layout constant as "PART NAME VALUE", one per line (tests/test_layout.py):
 * the ring's (shm/layout.h), the payload's (aiospec/payload.h), and the AIOSPEC_ aliases that
 * csrc uses for the ring's (aiospec/layout.h; one missing is a build error here). */
#include <stdio.h>

#include "aiospec/layout.h"

#define RING(name) printf("ring %s %llu\n", #name, (unsigned long long)(SHM_##name));
#define ALIAS(name) printf("alias %s %llu\n", #name, (unsigned long long)(AIOSPEC_##name));
#define PAYLOAD(name) printf("payload %s %llu\n", #name, (unsigned long long)(AIOSPEC_##name));

int main(void) {
  SHM_LAYOUT_CONSTANTS(RING)
  SHM_LAYOUT_CONSTANTS(ALIAS)
  AIOSPEC_PAYLOAD_CONSTANTS(PAYLOAD)
  return 0;
}
