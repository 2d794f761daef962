# Install layout and the Debian package. Included once from the top-level CMakeLists.txt.
#
#   cmake --install build --prefix DIR   DIR/bin/zcrelay (installed by proxy/CMakeLists.txt)
#                                        DIR/etc/zcrelay/zcrelay.yaml: the example config
#                                        DIR/lib/systemd/system/zcrelay.service
#                                        DIR/share/zcrelay/examples/: config/*.yaml, the drop-in,
#                                        the socket unit
#   cpack --config build/CPackConfig.cmake
#                                        zcrelay_<version>_<arch>.deb: the same under /usr,
#                                        except the config in /etc (a dpkg conffile)

# Installing (and cpack, which runs the `preinstall` target) packages what was built and builds
# nothing, as `cmake --install` does; `cmake --build build --target package` still builds first.
set(CMAKE_SKIP_INSTALL_ALL_DEPENDENCY ON)

set(ZCRELAY_EXAMPLES_DIR share/zcrelay/examples)
file(GLOB zcrelay_example_configs CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/config/*.yaml)
install(FILES ${zcrelay_example_configs} DESTINATION ${ZCRELAY_EXAMPLES_DIR})
install(FILES ${PROJECT_SOURCE_DIR}/deploy/systemd/zcrelay-sockmap.conf
              ${PROJECT_SOURCE_DIR}/deploy/systemd/zcrelay.socket
        DESTINATION ${ZCRELAY_EXAMPLES_DIR}/systemd)

# The config file and the unit are placed at install time, not configure time, because where
# they go depends on the prefix given then: /etc for /usr (the .deb, which CPack stages with
# DESTDIR and prefix /usr, as GNUInstallDirs does for that prefix), PREFIX/etc otherwise. The
# unit names the binary and the config by absolute path, so it is rewritten to that prefix too.
install(CODE "set(ZCRELAY_SOURCE_DIR \"${PROJECT_SOURCE_DIR}\")
set(ZCRELAY_STAGING_DIR \"${PROJECT_BINARY_DIR}/deploy-staging\")")
install(SCRIPT ${CMAKE_CURRENT_LIST_DIR}/InstallConfigAndUnit.cmake)

set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME zcrelay)
set(CPACK_PACKAGE_VENDOR "zcrelay")
set(CPACK_PACKAGE_CONTACT "zcrelay maintainers <maintainers@users.noreply.a-seed-8acc3ce0.example>"
    CACHE STRING "Maintainer field of the .deb")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "L4 TCP relay with io_uring, splice(2) and eBPF sockmap")
set(CPACK_PACKAGE_DESCRIPTION
    "zcrelay relays TCP connections without copying the bytes through user space: one io_uring\n\
per worker thread, splice(2) through pipes, or an eBPF sk_skb program redirecting between\n\
sockets in the kernel (mode: sockmap). Clusters with balancing and health checks, PROXY\n\
protocol, limits, reload on SIGHUP, Prometheus metrics.")
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
# Stage with DESTDIR and the real prefix, so the install script above sees /usr.
set(CPACK_SET_DESTDIR ON)
set(CPACK_INSTALL_PREFIX /usr)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_SECTION net)
set(CPACK_DEBIAN_PACKAGE_PRIORITY optional)
set(CPACK_DEBIAN_PACKAGE_MAINTAINER "${CPACK_PACKAGE_CONTACT}")
# Depends from what the binary really links (dpkg-shlibdeps on the staged binary): liburing2,
# libbpf1, libyaml-cpp0.7, libprometheus-cpp-core1.0, libmicrohttpd12, libstdc++6, libgcc-s1, libc6
# when this was written; tests/deploy/deb_test.sh checks it against readelf and ldd.
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
# The unit's ExecReload runs /bin/kill.
set(CPACK_DEBIAN_PACKAGE_DEPENDS procps)
# conffiles: dpkg keeps a locally edited config on upgrade. postinst/prerm/postrm: systemd
# daemon-reload, and a stop before removal; the service is not enabled or started on install,
# since it relays nothing useful until its config names real addresses.
set(CPACK_DEBIAN_PACKAGE_CONTROL_EXTRA
    ${PROJECT_SOURCE_DIR}/deploy/deb/conffiles ${PROJECT_SOURCE_DIR}/deploy/deb/postinst
    ${PROJECT_SOURCE_DIR}/deploy/deb/prerm ${PROJECT_SOURCE_DIR}/deploy/deb/postrm)
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)
include(CPack)
