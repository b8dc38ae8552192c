// tests/cluster/net_probe.cc — tcp_sockets_of: /proc/<pid>/fd and /proc/<pid>/net/tcp.
#include "tests/cluster/net_probe.h"

#include <arpa/inet.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

namespace troupe::test {
namespace {

// "0100007F:1F90" (little-endian IPv4 : port, hex) -> "127.0.0.1", 8080
void parse_addr(const std::string& s, std::string* ip, int* port) {
  const size_t colon = s.find(':');
  in_addr a{};
  a.s_addr = static_cast<uint32_t>(std::stoul(s.substr(0, colon), nullptr, 16));
  char buf[INET_ADDRSTRLEN] = {0};
  inet_ntop(AF_INET, &a, buf, sizeof buf);
  *ip = buf;
  *port = std::stoi(s.substr(colon + 1), nullptr, 16);
}

}  // namespace

std::vector<TcpSocket> tcp_sockets_of(pid_t pid) {
  std::set<std::string> inodes;
  std::error_code ec;
  const std::string proc = "/proc/" + std::to_string(pid);
  for (const auto& e : std::filesystem::directory_iterator(proc + "/fd", ec)) {
    char buf[128] = {0};
    const ssize_t n = ::readlink(e.path().c_str(), buf, sizeof buf - 1);
    if (n <= 0) continue;
    const std::string target(buf, static_cast<size_t>(n));
    if (target.rfind("socket:[", 0) == 0) inodes.insert(target.substr(8, target.size() - 9));
  }
  std::vector<TcpSocket> out;
  std::ifstream f(proc + "/net/tcp");
  std::string line;
  std::getline(f, line);  // header
  while (std::getline(f, line)) {
    std::istringstream ss(line);
    std::string sl, local, remote, st, queues, timer, retr, uid, timeout, inode;
    ss >> sl >> local >> remote >> st >> queues >> timer >> retr >> uid >> timeout >> inode;
    if (!inodes.count(inode)) continue;
    TcpSocket s;
    parse_addr(local, &s.local_ip, &s.local_port);
    parse_addr(remote, &s.remote_ip, &s.remote_port);
    s.listening = st == "0A";
    out.push_back(s);
  }
  return out;
}

}  // namespace troupe::test
