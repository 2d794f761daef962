# Runs at install time (install(SCRIPT) in Packaging.cmake), with CMAKE_INSTALL_PREFIX and
# DESTDIR as given then, ZCRELAY_SOURCE_DIR and ZCRELAY_STAGING_DIR set by Packaging.cmake.
if(CMAKE_INSTALL_PREFIX STREQUAL "/usr")
  set(etc_dir /etc)
else()
  set(etc_dir "${CMAKE_INSTALL_PREFIX}/etc")
endif()

# The default config is the example config. An existing one is someone's edited config: left
# alone (the .deb gets the same from dpkg's conffile handling).
set(config "${etc_dir}/zcrelay/zcrelay.yaml")
if(EXISTS "$ENV{DESTDIR}${config}")
  message(STATUS "Kept: $ENV{DESTDIR}${config} (exists; the shipped one is in the examples)")
else()
  file(INSTALL "${ZCRELAY_SOURCE_DIR}/config/zcrelay.example.yaml" DESTINATION "${etc_dir}/zcrelay"
       RENAME zcrelay.yaml PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ WORLD_READ)
endif()

file(READ "${ZCRELAY_SOURCE_DIR}/deploy/systemd/zcrelay.service" unit)
string(REPLACE "/usr/bin/zcrelay" "${CMAKE_INSTALL_PREFIX}/bin/zcrelay" unit "${unit}")
string(REPLACE "/etc/zcrelay/" "${etc_dir}/zcrelay/" unit "${unit}")
file(WRITE "${ZCRELAY_STAGING_DIR}/zcrelay.service" "${unit}")
file(INSTALL "${ZCRELAY_STAGING_DIR}/zcrelay.service"
     DESTINATION "${CMAKE_INSTALL_PREFIX}/lib/systemd/system"
     PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ WORLD_READ)
