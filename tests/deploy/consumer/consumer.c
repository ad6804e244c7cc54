/* A program of another project built against an installed hiqcache (install_consumer_test.sh):
 * checks the library's ABI and version, then asks a daemon that is not running for its
 * statistics, which must fail cleanly: HIQ_UNAVAILABLE (or HIQ_DEADLINE_EXCEEDED, on a machine
 * too loaded to see the refused connection within the call's 5 s) with a message.
 * Usage: consumer VERSION SOCKET_PATH. Exit 0 when all is as expected, 1 otherwise. */
#include <hiqcache/hiqcache_c.h>
#include <stdio.h>
#include <string.h>

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: consumer VERSION SOCKET_PATH\n");
    return 2;
  }
  if (hiq_abi_version() != HIQ_C_ABI_VERSION) {
    fprintf(stderr, "library ABI %d, header ABI %d\n", hiq_abi_version(), HIQ_C_ABI_VERSION);
    return 1;
  }
  if (strcmp(hiq_version(), argv[1]) != 0) {
    fprintf(stderr, "library version %s, expected %s\n", hiq_version(), argv[1]);
    return 1;
  }
  char target[4096];
  snprintf(target, sizeof(target), "unix://%s", argv[2]);
  hiq_client* client = NULL;
  int rc = hiq_connect(target, 5000, &client);
  if (rc != HIQ_OK || client == NULL) {
    fprintf(stderr, "hiq_connect: code %d: %s\n", rc, hiq_last_error());
    return 1;
  }
  hiq_stats stats;
  memset(&stats, 0, sizeof(stats));
  rc = hiq_get_stats(client, &stats);
  char error[1024];
  snprintf(error, sizeof(error), "%s", hiq_last_error());
  hiq_close(client);
  if ((rc != HIQ_UNAVAILABLE && rc != HIQ_DEADLINE_EXCEEDED) || error[0] == '\0') {
    fprintf(stderr, "hiq_get_stats without a daemon: code %d (want %d), message \"%s\"\n", rc,
            HIQ_UNAVAILABLE, error);
    return 1;
  }
  printf("libhiqcache %s (ABI %d): no daemon at %s: code %d, %s\n", hiq_version(),
         hiq_abi_version(), target, rc, error);
  return 0;
}
