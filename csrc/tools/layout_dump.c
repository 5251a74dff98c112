/* Prints every layout constant as "NAME VALUE", one per line (tests/test_layout.py). */
#include <stdio.h>

#include "aiospec/layout.h"

#define PRINT(name) printf("%s %llu\n", #name, (unsigned long long)(AIOSPEC_##name));

int main(void) {
  AIOSPEC_LAYOUT_CONSTANTS(PRINT)
  return 0;
}
