// A stand-alone libfuse3 program for launcher tests: `hello_fuse /dev/fd/N [content
// [read_work_ms]]` serves one file, "hello", on an already-mounted FUSE connection — as any
// libfuse3 program does when given /dev/fd/N as its mount point. read_work_ms: each first READ
// keeps a CPU busy that long before it is answered.
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "tests/testing/hello_fuse_server.h"

int main(int argc, char** argv) {
  if (argc < 2 || strncmp(argv[1], "/dev/fd/", 8) != 0) {
    fprintf(stderr, "usage: hello_fuse /dev/fd/N [content]\n");
    return 2;
  }
  int fd = atoi(argv[1] + 8);
  fusekeeper::HelloFuseServer server(fd, argc > 2 ? argv[2] : "hello from a launched program\n",
                                    argc > 3 ? atoi(argv[3]) : 0);
  return 0;  // ~HelloFuseServer waits for the session to end
}
