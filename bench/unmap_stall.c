// How long does tearing down a large mapping on one thread hold up another thread's mmap (thread
// stacks, large allocations, a driver's own mappings)? Thread A tears down BYTES of memory, either
// with one munmap or by madvise(MADV_DONTNEED) in CHUNK-sized pieces and then munmap, while thread B
// maps, touches and unmaps 1 MB in a loop and records its longest wait. FILE=1 maps /tmp/mm/big
// (make it first: dd if=/dev/zero of=/tmp/mm/big bs=1M count=4096; cat /tmp/mm/big >/dev/null),
// else anonymous memory (what a freed arena is).
//   gcc -O2 -o unmap_stall bench/unmap_stall.c -lpthread && ./unmap_stall MB CHUNK_MB FILE
// (bench/RESULTS.md session 30: vidgen's teardown threads discard pages in 64 MB pieces for this.)
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <pthread.h>
#include <time.h>
#include <fcntl.h>
#include <unistd.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static volatile int stop=0; static double worst=0; static long ops=0;
static void* prober(void*a){while(!stop){double t=now();void*p=mmap(0,1<<20,PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0);((char*)p)[0]=1;munmap(p,1<<20);double d=now()-t;if(d>worst)worst=d;ops++;}return 0;}
int main(int argc,char**argv){
  size_t bytes=(size_t)atol(argv[1])<<20; int chunked=atoi(argv[2]); int file=atoi(argv[3]);
  char*p;
  if(file){int fd=open("/tmp/mm/big",O_RDONLY);p=mmap(0,bytes,PROT_READ,MAP_PRIVATE,fd,0);volatile long s=0;for(size_t i=0;i<bytes;i+=4096)s+=p[i];}
  else{p=mmap(0,bytes,PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0);for(size_t i=0;i<bytes;i+=4096)p[i]=1;}
  pthread_t th;pthread_create(&th,0,prober,0);usleep(100000);worst=0;ops=0;
  double t=now();
  if(chunked){size_t c=(size_t)chunked<<20;for(size_t o=0;o<bytes;o+=c){size_t n=bytes-o<c?bytes-o:c;madvise(p+o,n,MADV_DONTNEED);}}
  munmap(p,bytes);
  double d=now()-t; usleep(50000); stop=1;pthread_join(th,0);
  printf("%s %zu MB chunked=%d MB: teardown %.3f s, prober worst wait %.3f s over %ld ops\n",file?"file":"anon",bytes>>20,chunked,d,worst,ops);
}
