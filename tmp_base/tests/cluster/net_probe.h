// tests/cluster/net_probe.h — defines what the cluster tests read from /proc about a
// process's TCP sockets: each socket it holds (its fds' socket inodes matched against
// /proc/<pid>/net/tcp) with local and remote address and whether it listens, so a test
// can prove which address a process binds and from which address it connects.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

namespace troupe::test {

struct TcpSocket {
  std::string local_ip;
  int local_port = 0;
  std::string remote_ip;
  int remote_port = 0;
  bool listening = false;
};

// The IPv4 TCP sockets process `pid` holds (empty when it is gone or unreadable).
std::vector<TcpSocket> tcp_sockets_of(pid_t pid);

}  // namespace troupe::test
